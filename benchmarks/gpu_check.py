"""GPU check of the pytorch backend's op sets; one table. Run it on a CUDA machine (the nox `gpu` session
does, after the `-m gpu` tests). Every model is built on the device from random weights: nothing is read
from outside.

Rows: the Triton kernel tests run natively; greedy parity with transformers on a tiny random Llama
(float32, eager and through CUDA graphs); the time of each op at Llama-3-8B shapes (bf16) with the
achieved memory bandwidth against the H200's ~4.8 TB/s (TFLOP/s for prefill attention); the torch
sampler against a decode step; end-to-end decode throughput of a Llama-3-8B-shaped random model at batch
1, 32 and 128, eager and with CUDA graphs; with 2+ GPUs, TP=2 against TP=1 through the backend (NCCL).
Columns are op sets (OP_SETS): another backend's kernels are
one more entry there. About 3-5 minutes on an H200 (budget: 8).

    python benchmarks/gpu_check.py                 # on a CUDA machine
    python benchmarks/gpu_check.py --cpu-dry-run   # every code path on the CPU at toy sizes (Triton
                                                   # interpreted, no CUDA graphs); the numbers mean nothing
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
PEAK_TBPS = 4.8  # H200 HBM3e
BLOCK = 16
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# Each op set's column; `kernel_tests` are pytest files (relative to the repo) that check it natively.
OP_SETS: dict[str, dict[str, Any]] = {
    "reference": {"kind": "reference", "kernel_tests": []},
    "triton": {"kind": "triton", "kernel_tests": ["plugins/pytorch_backend/tests/test_kernels_triton.py",
                                                  "plugins/pytorch_backend/tests/test_cuda_graphs.py"]},
}


@dataclass(frozen=True)
class Sizes:
    """Shapes of one run: Llama-3-8B on a GPU, toys for the CPU dry run."""

    hidden: int = 4096
    intermediate: int = 14336
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 128256
    max_positions: int = 8192
    decode_tokens: int = 128  # rows of the elementwise ops in a decode step
    prefill_tokens: int = 4096
    decode_cases: tuple[tuple[int, int], ...] = ((1, 8192), (32, 1024), (128, 1024))  # (batch, context)
    prefill_len: int = 2048
    e2e_batches: tuple[int, ...] = (1, 32, 128)
    e2e_context: int = 512
    e2e_steps: int = 32

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TOY = Sizes(hidden=128, intermediate=256, layers=2, heads=2, kv_heads=1, vocab=512, max_positions=256,
            decode_tokens=4, prefill_tokens=8, decode_cases=((2, 40),), prefill_len=20, e2e_batches=(1, 2),
            e2e_context=8, e2e_steps=2)


class Table:
    """Rows of (check, {column: value}); printed once at the end."""

    def __init__(self, columns: list[str]):
        self.columns = columns
        self.rows: list[tuple[str, dict[str, str]]] = []

    def add(self, check: str, values: dict[str, str]) -> None:
        self.rows.append((check, values))
        print(f"  {check}: {values}", file=sys.stderr, flush=True)

    def print(self) -> None:
        header = ["check", *self.columns]
        lines = [[check, *(values.get(c, "-") for c in self.columns)] for check, values in self.rows]
        widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
        for row in [header, ["-" * w for w in widths], *lines]:
            print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |")


def time_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median milliseconds of ``fn`` (triton's do_bench on CUDA, which flushes L2 between runs)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=60, return_mode="median"))
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def select(name: str, device: torch.device) -> SimpleNamespace:
    from core_pytorch_backend.kernels import select_ops

    return select_ops(device, kind=OP_SETS[name]["kind"])


# ---------------------------------------------------------------- kernel tests


def kernel_tests(table: Table, dry_run: bool) -> None:
    values = {}
    for name, spec in OP_SETS.items():
        if not spec["kernel_tests"]:
            continue
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *spec["kernel_tests"]]
        if dry_run:
            cmd += ["-k", "select_ops"]  # the interpreted suite takes minutes on a CPU
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
        values[name] = re.sub(r"=+", "", summary).strip()
        if done.returncode:
            print(done.stdout[-4000:], done.stderr[-2000:], file=sys.stderr)
    table.add("kernel tests, native (pytest)", values)


# ---------------------------------------------------------------- models and decode steps


def step_inputs(chunks: list[list[int]], computed: list[int], tables: list[list[int]], device: torch.device):
    """A StepInputs for the sequences' new tokens; every sequence samples."""
    from core_pytorch_backend.attention_metadata import AttentionMetadata
    from core_pytorch_backend.model_runner import StepInputs

    meta = AttentionMetadata.build(computed, [len(c) for c in chunks], tables, BLOCK, device)
    return StepInputs(input_ids=torch.tensor([t for c in chunks for t in c], device=device),
                      positions=meta.positions(), meta=meta, sample_indices=meta.last_token_indices(),
                      sampling=[None] * len(chunks))


def build_llama(config: Any, ops: SimpleNamespace, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Our Llama for ``config`` with random weights made on the device (norms near 1)."""
    from core_pytorch_backend.loader import build_model
    from core_pytorch_backend.models.llama import LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in dtype: no float32 copy of 8B weights
    try:
        model = build_model(config, {"LlamaForCausalLM": LlamaForCausalLM}, ops, device, dtype)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.02, generator=gen)
    return model.eval()


def make_runner(model, num_blocks: int, device: torch.device, dtype: torch.dtype):
    from core_pytorch_backend.model_runner import ModelRunner

    return ModelRunner(model, block_size=BLOCK, num_blocks=num_blocks, device=device, dtype=dtype)


def attach_graphs(runner, max_num_seqs: int, max_model_len: int) -> bool:
    """Decode CUDA graphs on ``runner`` when its op set can be captured; whether it got them."""
    from core_pytorch_backend.cuda_graphs import make_decode_graphs

    runner.decode_path = make_decode_graphs(runner.model, device=runner.device, enabled=True,
                                            block_size=BLOCK, max_model_len=max_model_len,
                                            max_num_seqs=max_num_seqs)
    return runner.decode_path is not None


# ---------------------------------------------------------------- greedy parity with transformers


def tiny_llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=500000.0,
                       rope_scaling=dict(LLAMA3_ROPE, original_max_position_embeddings=128))


def hf_greedy(config: Any, prompts: list[list[int]], new_tokens: int, device: torch.device):
    """transformers' greedy continuations (float32) and its weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).to(device).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen).to(device) * 0.1
            p.copy_(1.0 + noise if "norm" in name else noise)
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs, hf.state_dict()


def our_greedy(runner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Prefill all prompts in one step, then decode them together."""
    per_seq = -(-(max(map(len, prompts)) + new_tokens) // BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq))[::-1] for i in range(len(prompts))]
    outs: list[list[int]] = [[] for _ in prompts]
    chunks, computed = prompts, [0] * len(prompts)
    for _ in range(new_tokens):
        tokens = runner.execute(step_inputs(chunks, computed, tables, runner.device)).argmax(-1).tolist()
        computed = [c + len(chunk) for c, chunk in zip(computed, chunks, strict=True)]
        for out, token in zip(outs, tokens, strict=True):
            out.append(token)
        chunks = [[t] for t in tokens]
    return outs


def parity(table: Table, device: torch.device, graphs_possible: bool) -> None:
    config = tiny_llama_config()
    prompts = [[5, 80, 17, 200, 33, 9, 101, 7, 250, 4, 60], [300, 2, 71]]
    want, weights = hf_greedy(config, prompts, 24, device)
    values = {}
    for name in OP_SETS:
        model = build_llama(config, select(name, device), device, torch.float32)
        model.load_weights(weights.items())
        runner = make_runner(model, 2 * -(-(11 + 24) // BLOCK), device, torch.float32)
        results = {"eager": "ok" if our_greedy(runner, prompts, 24) == want else "MISMATCH"}
        if graphs_possible and model.ops.graph_safe:
            captured = attach_graphs(runner, 2, 64)
            same = captured and our_greedy(runner, prompts, 24) == want
            results["graphs"] = ("ok" if same else "MISMATCH") if captured else "capture FAILED (see log)"
        values[name] = ", ".join(f"{mode} {verdict}" for mode, verdict in results.items())
    table.add("greedy = transformers (tiny Llama fp32, 2 prompts x 24 tokens)", values)


# ---------------------------------------------------------------- per-op timing


@dataclass
class KernelCase:
    label: str
    call: Callable[[SimpleNamespace], Callable[[], Any]]  # op set -> a no-argument call
    bytes: int = 0  # memory traffic, for bandwidth
    flops: int = 0  # for compute-bound cases instead


def elementwise_cases(s: Sizes, device: torch.device, dtype: torch.dtype) -> list[KernelCase]:
    e = torch.finfo(dtype).bits // 8
    cases = []
    for t in (s.decode_tokens, s.prefill_tokens):
        x, res = (torch.randn(t, s.hidden, device=device, dtype=dtype) for _ in range(2))
        w = torch.ones(s.hidden, device=device, dtype=dtype)
        q = torch.randn(t, s.heads, s.head_dim, device=device, dtype=dtype)
        k = torch.randn(t, s.kv_heads, s.head_dim, device=device, dtype=dtype)
        pos = torch.randint(0, s.max_positions, (t,), device=device)
        cos, sin = (torch.rand(s.max_positions, s.head_dim // 2, device=device) for _ in range(2))
        gate_up = torch.randn(t, 2 * s.intermediate, device=device, dtype=dtype)
        cases += [
            KernelCase(f"rms_norm + residual [{t}x{s.hidden}]", lambda o, x=x, w=w, r=res: lambda: o.rms_norm(x, w, 1e-5, r),
                       bytes=4 * t * s.hidden * e),
            KernelCase(f"apply_rotary q[{t}x{s.heads}x{s.head_dim}] k[..x{s.kv_heads}x..]",
                       lambda o, q=q, k=k, p=pos, c=cos, n=sin: lambda: o.apply_rotary(q, k, p, c, n),
                       bytes=2 * t * (s.heads + s.kv_heads) * s.head_dim * e + 2 * t * s.head_dim * 4),
            KernelCase(f"silu_and_mul [{t}x{2 * s.intermediate}]", lambda o, g=gate_up: lambda: o.silu_and_mul(g),
                       bytes=3 * t * s.intermediate * e),
        ]
    return cases


def store_case(s: Sizes, device: torch.device, dtype: torch.dtype) -> KernelCase:
    t, e = s.decode_tokens, torch.finfo(dtype).bits // 8
    key, value = (torch.randn(t, s.kv_heads, s.head_dim, device=device, dtype=dtype) for _ in range(2))
    k_cache, v_cache = (torch.zeros(4 * t, BLOCK, s.kv_heads, s.head_dim, device=device, dtype=dtype)
                        for _ in range(2))
    slots = torch.randperm(4 * t * BLOCK, device=device)[:t]
    return KernelCase(f"store_kv_cache [{t}x{s.kv_heads}x{s.head_dim}]",
                      lambda o: lambda: o.store_kv_cache(key, value, k_cache, v_cache, slots),
                      bytes=4 * t * s.kv_heads * s.head_dim * e)


def attention_case(s: Sizes, batch: int, context: int, new: int, device: torch.device,
                   dtype: torch.dtype) -> KernelCase:
    """Decode (new = 1: bandwidth) or a fresh prompt's prefill (new = context: TFLOP/s)."""
    from core_pytorch_backend.attention_metadata import AttentionMetadata

    e, per_seq = torch.finfo(dtype).bits // 8, -(-context // BLOCK)
    k_cache, v_cache = (torch.randn(batch * per_seq, BLOCK, s.kv_heads, s.head_dim, device=device, dtype=dtype)
                        for _ in range(2))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    meta = AttentionMetadata.build([context - new] * batch, [new] * batch, tables, BLOCK, device)
    q = torch.randn(batch * new, s.heads, s.head_dim, device=device, dtype=dtype)
    call = lambda o: lambda: o.paged_attention(q, k_cache, v_cache, meta, s.head_dim**-0.5)  # noqa: E731
    if new == 1:
        return KernelCase(f"decode attention B={batch} ctx={context}", call,
                          bytes=2 * batch * context * s.kv_heads * s.head_dim * e)
    return KernelCase(f"prefill attention {batch}x{context} tokens (causal)", call,
                      flops=2 * batch * context * context * s.heads * s.head_dim)  # 4*L^2*H*D / 2


def kernel_timings(table: Table, s: Sizes, device: torch.device) -> None:
    dtype = torch.bfloat16
    cases = elementwise_cases(s, device, dtype) + [store_case(s, device, dtype)]
    cases += [attention_case(s, b, ctx, 1, device, dtype) for b, ctx in s.decode_cases]
    cases.append(attention_case(s, 1, s.prefill_len, s.prefill_len, device, dtype))
    op_sets = {name: select(name, device) for name in OP_SETS}
    for case in cases:
        values = {}
        for name, ops in op_sets.items():
            ms = time_ms(case.call(ops), device)
            if case.flops:
                values[name] = f"{ms * 1e3:.0f} us, {case.flops / ms / 1e9:.0f} TFLOP/s"
            else:
                tbps = case.bytes / ms / 1e9
                values[name] = f"{ms * 1e3:.1f} us, {tbps:.2f} TB/s ({100 * tbps / PEAK_TBPS:.0f}%)"
        table.add(case.label + " bf16", values)
    del cases
    gc.collect()


def sampler_timing(table: Table, s: Sizes, device: torch.device) -> None:
    """The torch sampler (top-k 50 / top-p 0.9 / temperature 0.8 on every row) at the largest batch."""
    from core_pytorch_backend.sampling import SamplingBatch, SamplingParams, SamplingRow, sample

    batch = max(s.e2e_batches)
    logits = torch.randn(batch, s.vocab, device=device)
    rows = [SamplingRow(SamplingParams(temperature=0.8, top_k=50, top_p=0.9))] * batch
    ms = time_ms(lambda: sample(logits, SamplingBatch.from_rows(rows, device)), device)
    table.add(f"sampler top-k/top-p B={batch} V={s.vocab} (torch, every set)",
              dict.fromkeys(OP_SETS, f"{ms:.2f} ms"))


# ---------------------------------------------------------------- end-to-end decode


def llama8b_config(s: Sizes) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                       num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                       max_position_embeddings=s.max_positions, rms_norm_eps=1e-5, rope_theta=500000.0,
                       rope_scaling=dict(LLAMA3_ROPE, original_max_position_embeddings=s.max_positions // 2),
                       tie_word_embeddings=False)


def decode_tokens_per_s(runner, batch: int, s: Sizes, warmup: int = 3) -> float:
    """Greedy decode steps of ``batch`` sequences of ``e2e_context`` (synthetic) cached tokens: host
    preparation, forward, logits and argmax included, as in the engine loop."""
    per_seq = -(-(s.e2e_context + warmup + s.e2e_steps) // BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    tokens, computed = [[7]] * batch, s.e2e_context
    for step in range(warmup + s.e2e_steps):
        if step == warmup:
            torch.cuda.synchronize() if runner.device.type == "cuda" else None
            start = time.perf_counter()
        logits = runner.execute(step_inputs(tokens, [computed] * batch, tables, runner.device))
        tokens = [[t] for t in logits.argmax(-1).tolist()]
        computed += 1
    return batch * s.e2e_steps / (time.perf_counter() - start)


def end_to_end(table: Table, s: Sizes, device: torch.device, graphs_possible: bool) -> None:
    dtype = torch.bfloat16
    per_seq = -(-(s.e2e_context + 3 + s.e2e_steps) // BLOCK)
    rows: dict[str, dict[str, str]] = {}
    for name in OP_SETS:
        runner = make_runner(build_llama(llama8b_config(s), select(name, device), device, dtype),
                             max(s.e2e_batches) * per_seq, device, dtype)
        modes = {"eager": False}
        if graphs_possible and runner.model.ops.graph_safe:
            if attach_graphs(runner, max(s.e2e_batches), s.max_positions):
                modes["CUDA graphs"] = True
            else:
                rows.setdefault("CUDA graph capture, 8B-shaped", {})[name] = "FAILED (see log)"
        graphs = runner.decode_path
        for mode, on in modes.items():
            runner.decode_path = graphs if on else None
            for batch in s.e2e_batches:
                label = f"decode tok/s, 8B-shaped bf16, B={batch}, ctx {s.e2e_context}, {mode}"
                rows.setdefault(label, {})[name] = f"{decode_tokens_per_s(runner, batch, s):.0f}"
        del runner, graphs
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
    for label, values in rows.items():  # eager rows first (every set), then graph rows
        table.add(label, values)


# ---------------------------------------------------------------- tensor parallelism


def tensor_parallel(table: Table, s: Sizes, device: torch.device) -> None:
    """TP=2 against TP=1 through the backend: greedy agreement and decode throughput of a random Llama
    saved to a temporary folder (needs 2 GPUs; the dry run runs both ranks on the CPU with gloo)."""
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        table.add("tensor parallel, TP=2 vs TP=1", {"triton": "skipped: one GPU"})
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu-check-tp-") as folder:
        path = save_random_llama(tp_llama_config(s), Path(folder))
        results = {tp: backend_greedy(path, tp, s, device) for tp in (1, 2)}
    (tokens1, rate1, column), (tokens2, rate2, _) = results[1], results[2]
    same = sum(a == b for x, y in zip(tokens1, tokens2, strict=True) for a, b in zip(x, y, strict=True))
    total = sum(len(x) for x in tokens1)
    table.add("tensor parallel: greedy tokens TP=2 equal to TP=1", {column: f"{same}/{total}"})
    label = f"tensor parallel: decode tok/s, B={TP_BATCH}, TP=1 / TP=2"
    table.add(label, {column: f"{rate1:.0f} / {rate2:.0f}"})


TP_BATCH = 32


def tp_llama_config(s: Sizes) -> Any:
    """A ~0.6B Llama on a GPU (8 layers of 2048), the toy on the CPU."""
    from transformers import LlamaConfig

    hidden, inter, layers = (128, 256, 2) if s is TOY else (2048, 8192, 8)
    return LlamaConfig(vocab_size=s.vocab if s is TOY else 32000, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=16 if s is not TOY else 4,
                       num_key_value_heads=8 if s is not TOY else 2, max_position_embeddings=1024,
                       tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


def save_random_llama(config: Any, folder: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():  # weights far from ties, as the tests' reinit_ does
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def backend_greedy(path: Path, tp: int, s: Sizes, device: torch.device) -> tuple[list[list[int]], float, str]:
    """(greedy tokens of TP_BATCH prompts, their decode tok/s, the op set's column) through the backend."""
    import asyncio

    from core.backend import GenerateRequest
    from core.config import EngineConfig, GenerationConfig
    from core_pytorch_backend.backend import PytorchBackend

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    budget = 2.0 if device.type == "cuda" else 0.01
    backend = PytorchBackend(EngineConfig(model=str(path), dtype=dtype, device=str(device),
                                          tensor_parallel_size=tp, kv_cache_memory_gib=budget))
    new = 4 * s.e2e_steps
    config = GenerationConfig(temperature=0.0, max_new_tokens=new, ignore_eos=True)

    async def one(i: int) -> list[int]:
        prompt = [(7 * i + 13 * j) % 500 for j in range(16 + i)]
        request = GenerateRequest(f"tp-{tp}-{i}", prompt, config, max_new_tokens=new)
        return [t async for out in backend.generate(request) for t in out.token_ids]

    async def run() -> tuple[list[list[int]], float]:
        await asyncio.gather(*(one(i) for i in range(2)))  # warm-up
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(TP_BATCH)))
        rate = sum(map(len, tokens)) / (time.perf_counter() - start)
        await backend.close()
        return list(tokens), rate

    tokens, rate = asyncio.run(run())
    column = "triton" if backend.ops.name == "triton" else "reference"
    return tokens, rate, column


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="walk every code path on the CPU at toy sizes")
    args = parser.parse_args()
    if args.cpu_dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernels are first imported
        device, sizes = torch.device("cpu"), TOY
    elif torch.cuda.is_available():
        device, sizes = torch.device("cuda"), Sizes()
    else:
        print("gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False); nothing was checked")
        return 1
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run: numbers mean nothing)"
    print(f"# gpu_check on {name}; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    table, started, spent = Table(list(OP_SETS)), time.perf_counter(), {}
    sections = [("kernel tests", lambda: kernel_tests(table, args.cpu_dry_run)),
                ("parity", lambda: parity(table, device, device.type == "cuda")),
                ("kernel timing", lambda: kernel_timings(table, sizes, device)),
                ("sampler", lambda: sampler_timing(table, sizes, device)),
                ("end to end", lambda: end_to_end(table, sizes, device, device.type == "cuda")),
                ("tensor parallel", lambda: tensor_parallel(table, sizes, device))]
    for section, run in sections:
        t0 = time.perf_counter()
        run()
        spent[section] = time.perf_counter() - t0
    table.print()
    print(f"\n{time.perf_counter() - started:.0f} s in all: " + ", ".join(f"{k} {v:.0f} s" for k, v in spent.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
