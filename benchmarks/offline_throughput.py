"""Offline decode throughput of the pytorch backend vs transformers' batched generate (same weights).

    python benchmarks/offline_throughput.py [--concurrency 1 8 32 64] [--dtype bfloat16] [--systems core transformers]

Prompts of 128 tokens, 128 output tokens each, ignore_eos, greedy. Each system runs in its own
subprocess (so each peak resident memory is its own), on the same dense weights: core serves the default
GGUF through its converted HF folder; transformers loads that same folder (its own GGUF path keeps the
weights packed and dequantizes in every matmul, which is not the comparison asked for).

Per concurrency C it prints output tokens/s (all C requests at once: AsyncEngine for core, one padded
batch through `generate` for transformers); at C = 1 also time to first token and decode tokens/s
(tokens after the first over the time after the first). Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import resource
import subprocess
import sys
import time

PROMPT_SEED = 11


def make_prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    return [[(97 * i + 31 * j + PROMPT_SEED) % (vocab - 100) + 50 for j in range(length)] for i in range(count)]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- core -------------------------------------------------------------------------------------------------


async def run_core(args) -> dict:
    from core.config import EngineConfig, GenerationConfig
    from core.engine import AsyncEngine
    from core.response import collect
    from core_pytorch_backend.backend import PytorchBackend

    engine = AsyncEngine(PytorchBackend(EngineConfig(dtype=args.dtype, quantization=args.quantization,
                                                     max_num_batched_tokens=4096,
                                                     max_num_seqs=max(args.concurrency))))
    vocab = engine.model_info.vocab_size
    config = GenerationConfig(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    await collect(engine.generate(make_prompts(2, 16, vocab)[0], config.replace(max_new_tokens=4)))  # warm-up
    rows = {}
    for c in args.concurrency:
        prompts = make_prompts(c, args.prompt_len, vocab)
        if c == 1:
            start, first, count = time.perf_counter(), None, 0
            async for out in engine.generate(prompts[0], config):
                first = first or time.perf_counter()
                count = out.completion_tokens
            end = time.perf_counter()
            rows[c] = {"tok_s": count / (end - start), "ttft_ms": (first - start) * 1e3,
                       "decode_tok_s": (count - 1) / (end - first)}
        else:
            start = time.perf_counter()
            done = await asyncio.gather(*(collect(engine.generate(p, config)) for p in prompts))
            rows[c] = {"tok_s": sum(len(r.token_ids) for r in done) / (time.perf_counter() - start)}
        print(f"  core C={c}: {rows[c]}", file=sys.stderr, flush=True)
    await engine.close()
    return rows


# -- transformers -----------------------------------------------------------------------------------------


def run_transformers(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from core_pytorch_backend.loader import cached_gguf_folder, default_model_path

    folder = cached_gguf_folder(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, args.dtype)).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: neither stop nor suppress

    def generate(prompts, new_tokens):
        ids = torch.tensor(prompts)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
        return (out.shape[1] - ids.shape[1]) * ids.shape[0], time.perf_counter() - start

    vocab = model.config.vocab_size
    generate(make_prompts(2, 16, vocab), 4)  # warm-up
    rows = {}
    for c in args.concurrency:
        prompts = make_prompts(c, args.prompt_len, vocab)
        tokens, elapsed = generate(prompts, args.new_tokens)
        rows[c] = {"tok_s": tokens / elapsed}
        if c == 1:
            _, ttft = generate(prompts, 1)
            rows[c].update(ttft_ms=ttft * 1e3, decode_tok_s=(tokens - 1) / (elapsed - ttft))
        print(f"  transformers C={c}: {rows[c]}", file=sys.stderr, flush=True)
    return rows


# -- driver -----------------------------------------------------------------------------------------------


def child(args) -> None:
    rows = asyncio.run(run_core(args)) if args.child == "core" else run_transformers(args)
    print(json.dumps({"rows": rows, "peak_rss_mib": peak_rss_mib()}))


def run_child(system: str, argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", system, *argv], stdout=subprocess.PIPE,
                          text=True, check=False)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(results: dict[str, dict], args) -> None:
    import torch

    print(f"# offline throughput, {args.dtype}, core weights {args.quantization}, prompt {args.prompt_len} / output {args.new_tokens} tokens; "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    names = list(results)
    print(f"{'C':>4} " + " ".join(f"{n + ' tok/s':>18}" for n in names) + f" {'ratio':>6}")
    for c in args.concurrency:
        vals = [results[n].get("rows", {}).get(str(c), {}).get("tok_s", float("nan")) for n in names]
        ratio = vals[0] / vals[1] if len(vals) > 1 and vals[1] else float("nan")
        print(f"{c:>4} " + " ".join(f"{v:>18.1f}" for v in vals) + f" {ratio:>6.2f}")
    for n in names:
        one = results[n].get("rows", {}).get("1")
        if one:
            print(f"{n}: single stream TTFT {one['ttft_ms']:.0f} ms, decode {one['decode_tok_s']:.1f} tok/s")
        print(f"{n}: peak RSS {results[n].get('peak_rss_mib', float('nan')):.0f} MiB"
              + (f" ({results[n]['error']})" if "error" in results[n] else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32", "float16"])
    parser.add_argument("--quantization", default="none", choices=["auto", "none", "int8", "int4"],
                        help="core's weights: none (dense, the transformers comparison), auto (the GGUF's packed "
                             "tensors: what `core serve` does), int8 / int4")
    parser.add_argument("--systems", nargs="+", default=["core", "transformers"], choices=["core", "transformers"])
    parser.add_argument("--child", choices=["core", "transformers"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    argv = ["--concurrency", *map(str, args.concurrency), "--prompt-len", str(args.prompt_len),
            "--new-tokens", str(args.new_tokens), "--dtype", args.dtype, "--quantization", args.quantization]
    report({system: run_child(system, argv) for system in args.systems}, args)


if __name__ == "__main__":
    main()
