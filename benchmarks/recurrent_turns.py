"""A multi-turn chat on a hybrid (recurrent-state) model, prefix caching on and off: how long each turn takes
to its first token, and how many of its prompt tokens came from the cache (core/scheduling/state_cache.py).

    python benchmarks/recurrent_turns.py [--models qwen3.5 lfm2 granite4h] [--first 1024] [--reply 32]
        [--message 48] [--turns 4] [--dtype bfloat16]

Random weights of the real models' shapes (benchmarks/recurrent_step.py's), loaded the way the server loads
them, driven through the engine (core.engine.AsyncEngine) in this process: turn t's prompt is turn t-1's
prompt, its reply (``--reply`` tokens, greedy, ignore_eos) and a new message of ``--message`` tokens. With
prefix caching, turn t > 1 restores the state kept at the last block boundary of turn t-1's prompt and
computes the rest; without, it computes the whole conversation again.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from recurrent_step import MODELS, save_random  # noqa: E402

from core.config import EngineConfig, GenerationConfig  # noqa: E402
from core.engine import AsyncEngine  # noqa: E402


def tokens(count: int, seed: int) -> list[int]:
    return [(seed * 7919 + 104729 * j) % 30000 + 100 for j in range(count)]


async def chat(path: Path, args: argparse.Namespace, caching: bool) -> list[tuple[float, int, int]]:
    """(seconds to the first token, prompt tokens, cached tokens) of each turn."""
    from core_pytorch_backend.backend import PytorchBackend

    engine = AsyncEngine(PytorchBackend(EngineConfig(model=str(path), dtype=args.dtype, enable_prefix_caching=caching,
                                                     max_num_batched_tokens=2048)))
    config = GenerationConfig(temperature=0.0, max_new_tokens=args.reply, ignore_eos=True)
    history, turns = tokens(args.first, 1), []
    try:
        for turn in range(args.turns):
            if turn:
                history = history + tokens(args.message, turn + 1)
            start = time.perf_counter()
            first = None
            reply: list[int] = []
            cached = 0
            async for out in engine.generate(history, config):
                first = first or time.perf_counter() - start
                reply.extend(out.token_ids)
                cached = max(cached, out.cached_tokens)
            turns.append((first, len(history), cached))
            history = history + reply
    finally:
        await engine.close()
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3.5"], choices=[m for m in MODELS if m != "qwen3"])
    parser.add_argument("--first", type=int, default=1024)
    parser.add_argument("--reply", type=int, default=32)
    parser.add_argument("--message", type=int, default=48)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            path, params = save_random(name, Path(folder))
            print(f"{name}-class, {params / 1e6:.0f}M parameters, {args.dtype}: first prompt {args.first} tokens, "
                  f"replies {args.reply}, messages {args.message}")
            results = {caching: asyncio.run(chat(path, args, caching)) for caching in (False, True)}
            for turn, (off, on) in enumerate(zip(results[False], results[True], strict=True), start=1):
                print(f"  turn {turn}: prompt {on[1]:>5} tokens | TTFT without prefix caching {off[0] * 1e3:7.0f} ms"
                      f" | with {on[0] * 1e3:7.0f} ms ({on[2]} cached) | {off[0] / on[0]:.1f}x")


if __name__ == "__main__":
    main()
