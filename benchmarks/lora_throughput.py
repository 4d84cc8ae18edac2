"""Multi-LoRA decode throughput: C concurrent requests spread over N adapters vs C on the base model alone.

    python benchmarks/lora_throughput.py [--concurrency 8] [--adapters 4] [--rank 16] [--rounds 3]

The default model (its GGUF's converted HF folder gives transformers + peft the base to build the
adapters on: random, non-zero A and B on q/k/v/o and gate/up/down). One engine serves both runs, with
`--max-loras` = the number of adapters; each round runs the base batch then the adapter batch (request i
names adapter i % N), greedy, ignore_eos; the best round of each is kept. Prints output tokens/s of both
and their ratio (the issue's target: at least 0.8). Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import tempfile
import time
from pathlib import Path

PROMPT_SEED = 11


def make_prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    return [[(97 * i + 31 * j + PROMPT_SEED) % (vocab - 100) + 50 for j in range(length)] for i in range(count)]


def make_adapters(root: Path, count: int, rank: int) -> dict[str, str]:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from core_pytorch_backend.loader import cached_gguf_folder, default_model_path

    folder = cached_gguf_folder(default_model_path())
    made = {}
    for i in range(count):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        peft_model = peft.get_peft_model(model, config)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.02)
        peft_model.save_pretrained(root / f"lora{i}")
        made[f"lora{i}"] = str(root / f"lora{i}")
    return made


async def run(args, adapters: dict[str, str]) -> dict[str, float]:
    from core.adapters import AdapterPolicy, LoraModule
    from core.config import EngineConfig, GenerationConfig
    from core.engine import AsyncEngine
    from core.response import collect
    from core_pytorch_backend.backend import PytorchBackend

    policy = AdapterPolicy(lora_modules=tuple(LoraModule(n, p) for n, p in adapters.items()),
                           max_loras=len(adapters), max_lora_rank=args.rank)
    options = {k: v for k, v in (("dtype", args.dtype), ("quantization", args.quantization)) if v is not None}
    engine = AsyncEngine(PytorchBackend(EngineConfig(max_num_seqs=args.concurrency, adapters=policy, **options)))
    config = GenerationConfig(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    prompts = make_prompts(args.concurrency, args.prompt_len, engine.model_info.vocab_size)
    names = list(adapters)

    async def batch(adapter_of) -> float:
        start = time.perf_counter()
        done = await asyncio.gather(*(collect(engine.generate(p, config.replace(adapter=adapter_of(i))))
                                      for i, p in enumerate(prompts)))
        return sum(len(r.token_ids) for r in done) / (time.perf_counter() - start)

    await batch(lambda i: names[i % len(names)])  # warm-up: every adapter resident, every shape seen
    best = {"base": 0.0, "adapters": 0.0}
    for r in range(args.rounds):
        base = await batch(lambda i: None)
        spread = await batch(lambda i: names[i % len(names)])
        print(f"  round {r}: base {base:.1f} tok/s, {len(names)} adapters {spread:.1f} tok/s", file=sys.stderr)
        best = {"base": max(best["base"], base), "adapters": max(best["adapters"], spread)}
    await engine.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="the engine's default unless given")
    parser.add_argument("--quantization", default=None, help="the engine's default unless given")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        adapters = make_adapters(Path(root), args.adapters, args.rank)
        best = asyncio.run(run(args, adapters))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"C={args.concurrency}, {args.adapters} adapters of rank {args.rank}, {args.prompt_len} prompt + "
          f"{args.new_tokens} new tokens, {cpu}")
    print(f"base: {best['base']:.1f} output tok/s; over {args.adapters} adapters: {best['adapters']:.1f} "
          f"output tok/s; ratio {best['adapters'] / best['base']:.2f}")


if __name__ == "__main__":
    main()
