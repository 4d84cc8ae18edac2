"""Where one decode step of the pytorch backend goes: its phases timed, and its torch ops counted.

    python benchmarks/decode_step.py [--batch 1 64] [--dtype auto] [--steps 40] [--profile] [--eager]
        [--amx-rows prompt all] [--kv-cache-dtype auto int8] [--repeats 1] [--paths stack modules]
        [--model PATH --quantization int4] [--experts native python]

Runs the engine loop's step by hand (scheduler -> ModelRunner.prepare -> execute -> SamplingBatch +
sample -> scheduler.update) on the default model, greedy, after a 128-token prompt per sequence, on the
calling thread, through the runner's decode path as the server takes it (the native decode stack on
the CPU; ``--eager``: the model's modules, as ``--enforce-eager``). Per batch size it prints the median milliseconds of each phase over --steps decode
steps, and the time the prefill of the batch's prompts took (one step of B x 128 tokens: the packed
matmuls' AMX tile loop where this CPU has it). ``--amx-rows prompt all`` builds a runner per rule of
native/tile_rows.py (``--kv-cache-dtype auto int8`` one per KV cache, the backend option's values) and alternates them ``--repeats`` times per batch size (a ratio taken on a VM whose
speed drifts needs them side by side). ``--profile`` adds a torch.profiler table of a few decode steps: ops per step and per layer, and
the ops by self time.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import core_pytorch_backend  # noqa: F401  (before torch: large tensors on huge pages, as the server has them)

PROMPT_LEN = 128


def build(dtype: str, max_seqs: int, eager: bool = False, amx_rows: str = "prompt", kv_cache_dtype: str = "auto",
          model: str | None = None, quantization: str = "auto"):
    from core.scheduling import BlockManager, Scheduler
    from core_pytorch_backend.kernels import kv_int8, select_ops
    from core_pytorch_backend.loader import default_model_path, load_checkpoint
    from core_pytorch_backend.model_runner import ModelRunner, kv_cache_blocks
    from core_pytorch_backend.native_decode import make_native_decode

    ops = select_ops("cpu")
    loaded = load_checkpoint(model or default_model_path(), dtype=dtype, ops=ops, quantization=quantization)
    block_size = 16
    kv_dtype = kv_int8.DTYPE if kv_cache_dtype == "int8" else loaded.kv_cache_dtype  # as the backend's option
    blocks = kv_cache_blocks(loaded.model, block_size, kv_dtype, torch.device("cpu"), 1.0, 0.9)
    runner = ModelRunner(loaded.model, block_size=block_size, num_blocks=blocks, device=torch.device("cpu"),
                         dtype=loaded.dtype, kv_cache_dtype=kv_dtype,
                         decode_path=lambda model: make_native_decode(model, device=torch.device("cpu"),
                                                                      enabled=not eager),
                         tile_rule=amx_rows)
    scheduler = Scheduler(BlockManager(blocks, block_size, False), max_num_seqs=max_seqs,
                          max_num_batched_tokens=8192)
    return runner, scheduler


def python_expert_loops(model: torch.nn.Module) -> None:
    """Every sparse MoE block of ``model`` routes in torch and mixes its experts in Python (sparse_moe.mix_experts),
    as before native/expert_mix.py (and MoE layers then take the modules, not the native decode stack)."""
    from core_pytorch_backend.models.sparse_moe import SparseMoeBlock

    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.native_kernel = lambda device: None


def stub_matmuls(model: torch.nn.Module) -> None:
    """Every ``matmul`` (linear layers, LM head) returns cached zeros of its output's shape (learnt
    from one real call per input shape, so packed weights of any layout work)."""
    for module in model.modules():
        if hasattr(module, "matmul"):
            module.matmul = _zeros_like_output_of(module.matmul)


def _zeros_like_output_of(matmul):
    outputs: dict[tuple, torch.Tensor] = {}

    def stub(x, weight, bias):
        key = (tuple(x.shape), x.dtype)
        if key not in outputs:
            outputs[key] = torch.zeros_like(matmul(x, weight, bias))
        return outputs[key]
    return stub


@functools.cache
def _argmax():
    """The CPU op set's argmax of the greedy rows, as the backend hands it to EngineLoop."""
    from core_pytorch_backend.kernels import select_ops

    return getattr(select_ops("cpu"), "argmax_rows", None)


def step(runner, scheduler, times: dict[str, list[float]] | None = None) -> None:
    """One engine step, as EngineLoop._step runs it (greedy rows, no logprobs, no penalties)."""
    from core_pytorch_backend.sampling import SamplingBatch, SamplingParams, SamplingRow, sample

    marks = [time.perf_counter()]
    out = scheduler.schedule()
    marks.append(time.perf_counter())
    inputs = runner.prepare(out.scheduled)
    marks.append(time.perf_counter())
    logits = runner.execute(inputs)
    marks.append(time.perf_counter())
    greedy = SamplingParams(temperature=0.0)
    rows = [SamplingRow(greedy, s.seq.prompt_token_ids, s.seq.output_token_ids) for s in inputs.sampling]
    result = sample(logits, SamplingBatch.from_rows(rows, device=logits.device), argmax=_argmax())
    marks.append(time.perf_counter())
    scheduler.update(out, {s.seq.seq_id: t for s, t in zip(inputs.sampling, result.token_ids, strict=True)})
    marks.append(time.perf_counter())
    if times is not None:
        phases = ("schedule", "prepare", "execute", "sample", "update")
        for name, a, b in zip(phases, marks[:-1], marks[1:], strict=True):
            times.setdefault(name, []).append((b - a) * 1e3)
        times.setdefault("total", []).append((marks[-1] - marks[0]) * 1e3)


def start(runner, scheduler, batch: int, vocab: int) -> None:
    """Add ``batch`` sequences and run until every one is decoding."""
    from core.scheduling import Sequence

    for i in range(batch):
        scheduler.add(Sequence(f"s{i}", [(97 * i + 31 * j + 11) % (vocab - 100) + 50 for j in range(PROMPT_LEN)]))
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in scheduler.running + list(scheduler.waiting)):
        step(runner, scheduler)


def finish(scheduler) -> None:
    for seq in list(scheduler.running):
        scheduler.finish(seq)


def profile(runner, scheduler, steps: int, num_layers: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(runner, scheduler)
    events = prof.key_averages()
    aten = [e for e in events if e.key.startswith("aten::")]
    # top-level aten ops only (an op called inside another op is counted by its caller)
    top_level = sum(e.count for e in aten) - _nested_count(prof)
    print(f"  aten ops per step: {top_level / steps:.0f} top level ({sum(e.count for e in aten) / steps:.0f} "
          f"with nested); per layer ~{top_level / steps / num_layers:.1f}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40))


def _nested_count(prof) -> int:
    nested = 0
    for event in prof.events():
        if event.name.startswith("aten::"):
            nested += sum(1 for child in event.cpu_children if child.name.startswith("aten::"))
    return nested


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="the model's dtype (default: what the server runs, load_checkpoint's auto)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--stub-matmuls", action="store_true", help="time all but the matmuls")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--eager", action="store_true", help="every layer through its modules (no native stack)")
    parser.add_argument("--amx-rows", nargs="+", default=["prompt"], choices=["prompt", "all", "none"],
                        help="the rules of native/tile_rows.py to run side by side (on a CPU with AMX tiles)")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "int8"],
                        help="the KV caches to run side by side (the backend option kv_cache_dtype)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every variant per batch size")
    parser.add_argument("--paths", nargs="+", default=None, choices=["stack", "modules"],
                        help="decode paths to run side by side: the native stack, the modules (--eager: modules)")
    parser.add_argument("--model", help="a checkpoint folder or GGUF file instead of the default model")
    parser.add_argument("--quantization", default="auto", help="load_checkpoint's (int8, int4: packed weights)")
    parser.add_argument("--experts", nargs="+", default=["native"], choices=["native", "python"],
                        help="a MoE model's expert loops to run side by side: one native call a block "
                             "(native/expert_mix.py) or sparse_moe.mix_experts")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = args.paths or (["modules"] if args.eager else ["stack"])
    built = {(rule, kv, path, experts): build(args.dtype, max(args.batch), path == "modules", rule, kv, args.model,
                                              args.quantization)
             for rule in args.amx_rows for kv in args.kv_cache_dtype for path in paths for experts in args.experts}
    for (*_, experts), (runner, _) in built.items():
        if experts == "python":
            python_expert_loops(runner.model)
            if runner.decode_path is not None:
                runner.decode_path.release()  # described again: its MoE layers then take the modules
    for runner, _ in built.values():
        if args.stub_matmuls:
            stub_matmuls(runner.model)
    runner = next(iter(built.values()))[0]
    vocab = runner.model.config.vocab_size
    path = ", ".join(dict.fromkeys("modules" if r.decode_path is None else type(r.decode_path).__name__
                                   for r, _ in built.values()))
    tiles = f"AMX tiles for rows: {', '.join(args.amx_rows)}" if runner.marks_tile_rows else "no AMX tiles"
    caches = ", ".join(str(r.kv_cache_dtype) for r, _ in built.values()) if len(args.kv_cache_dtype) > 1 else None
    print(f"# decode step, {runner.dtype} (KV cache {caches or runner.kv_cache_dtype}), {path}"
          f"{', matmuls stubbed' if args.stub_matmuls else ''}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {tiles}")
    for batch in args.batch:
        for _ in range(args.repeats):
            for (rule, kv, path, experts), (runner, scheduler) in built.items():
                measure(runner, scheduler, batch, vocab, args, label=f"B={batch:<3}" + (
                    f" amx-rows {rule:<6}" if len(args.amx_rows) > 1 else "") + (
                    f" kv {kv:<4}" if len(args.kv_cache_dtype) > 1 else "") + (
                    f" {path:<7}" if len(paths) > 1 else "") + (
                    f" experts {experts:<6}" if len(args.experts) > 1 else ""))


def measure(runner, scheduler, batch: int, vocab: int, args, label: str) -> None:
    """Prefill `batch` prompts, then time --steps decode steps (after 5 of warm-up)."""
    began = time.perf_counter()
    start(runner, scheduler, batch, vocab)
    prefill = time.perf_counter() - began
    for _ in range(5):
        step(runner, scheduler)  # warm-up
    times: dict[str, list[float]] = {}
    for _ in range(args.steps):
        step(runner, scheduler, times)
    medians = " ".join(f"{name} {statistics.median(v):.2f}" for name, v in times.items())
    print(f"{label} prefill {prefill:.2f} s; decode median ms: {medians}", flush=True)
    if args.profile:
        profile(runner, scheduler, 5, runner.model.num_layers)
    finish(scheduler)


if __name__ == "__main__":
    main()
