"""Offline decode throughput of the pytorch backend vs transformers' batched generate (same weights).

    python benchmarks/offline_throughput.py --concurrency 1 8 32 64 [--dtype bfloat16] [--skip-transformers]

Prompts of ~128 tokens, 128 output tokens each, ignore_eos. Prints one row per concurrency: output
tokens/s of core (all requests submitted at once through AsyncEngine) and of transformers' generate on
a padded batch, plus the process's peak resident memory. Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time

import torch

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.response import collect
from core_pytorch_backend.backend import PytorchBackend
from core_pytorch_backend.loader import default_model_path


def make_prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    return [[(97 * i + 31 * j + 11) % (vocab - 100) + 50 for j in range(length)] for i in range(count)]


async def core_throughput(engine: AsyncEngine, prompts: list[list[int]], new_tokens: int) -> float:
    config = GenerationConfig(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    responses = await asyncio.gather(*(collect(engine.generate(p, config)) for p in prompts))
    elapsed = time.perf_counter() - start
    return sum(len(r.token_ids) for r in responses) / elapsed


def transformers_throughput(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / elapsed


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    engine = AsyncEngine(PytorchBackend(EngineConfig(dtype=args.dtype, max_num_batched_tokens=4096)))
    hf = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        path = default_model_path()
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=getattr(torch, args.dtype)).eval()
    vocab = engine.model_info.vocab_size
    await core_throughput(engine, make_prompts(2, 16, vocab), 4)  # warm-up
    print(f"{'streams':>8} {'core tok/s':>11} {'transformers tok/s':>19} {'ratio':>6} {'peak RSS MiB':>13}")
    for c in args.concurrency:
        prompts = make_prompts(c, args.prompt_len, vocab)
        ours = await core_throughput(engine, prompts, args.new_tokens)
        theirs = transformers_throughput(hf, prompts, args.new_tokens) if hf is not None else float("nan")
        print(f"{c:>8} {ours:>11.1f} {theirs:>19.1f} {ours / theirs:>6.2f} {peak_rss_mib():>13.0f}", flush=True)
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
