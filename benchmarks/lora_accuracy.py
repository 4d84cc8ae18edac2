"""How closely LoRA adapters kept in bfloat16 follow the same adapters in float32, over the packed default model.

    python benchmarks/lora_accuracy.py [--tokens 2000] [--rank 16] [--adapters 2]

Over quantized base weights the pytorch backend keeps adapter weights in bfloat16 (lora/manager.py): half
the bytes a decode step reads, where those bytes bound the step. This measures what it costs: the default
model's GGUF served packed, each of ``--adapters`` random adapters (lora_throughput.py's: non-zero A and B
on every projection) loaded once in float32 and once in bfloat16, teacher-forced over ``--tokens`` tokens
of the Python help topics (``plugins/pytorch_backend/tests/quality.py``) through the paged KV cache. Prints
top-1 agreement and the perplexity ratio of bfloat16 against float32, per adapter. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from lora_throughput import make_adapters
from quant_accuracy import load_quality


def score(quality, loaded, manager, name: str, tokens: list[int], chunk: int):
    """Teacher-forced run of `loaded` with every row through adapter `name`."""
    slot, _ = manager.acquire(name)
    forward = loaded.model.forward

    def with_adapter(input_ids, *args, **kwargs):
        manager.step.set_rows([slot] * input_ids.shape[0], input_ids.device)
        try:
            return forward(input_ids, *args, **kwargs)
        finally:
            manager.step.clear()

    loaded.model.forward = with_adapter
    try:
        return quality.teacher_forced(loaded, tokens, chunk=chunk)
    finally:
        loaded.model.forward = forward
        manager.release(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=2)
    args = parser.parse_args()

    from core.adapters import AdapterPolicy, LoraModule
    from core_pytorch_backend.loader import default_model_path, load_checkpoint
    from core_pytorch_backend.lora.manager import AdapterManager

    quality = load_quality()
    loaded = load_checkpoint(default_model_path())
    tokens = quality.reference_tokens(loaded.tokenizer, args.tokens)
    with tempfile.TemporaryDirectory() as root:
        adapters = make_adapters(Path(root), args.adapters, args.rank)
        policy = AdapterPolicy(max_loras=len(adapters), max_lora_rank=args.rank)
        runs = {}
        for weights_dtype in (torch.float32, torch.bfloat16):
            manager = AdapterManager(loaded.model, policy, torch.device("cpu"), loaded.dtype, weights_dtype)
            for name, path in adapters.items():
                module = LoraModule(name, path)
                manager.add(module, manager.read(module))
                runs[name, weights_dtype] = score(quality, loaded, manager, name, tokens, args.chunk)
    print(f"\n{default_model_path().name} packed ({loaded.quantization}), {args.tokens} positions, "
          f"random adapters of rank {args.rank}\n")
    for name in adapters:
        result = quality.compare(runs[name, torch.bfloat16], runs[name, torch.float32])
        print(f"{name}: adapter weights in bfloat16 vs float32: {result}")


if __name__ == "__main__":
    main()
