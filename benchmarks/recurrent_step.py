"""Prefill and decode speed of hybrid (recurrent-state) models on the pytorch backend, beside a transformer of
the same width, on random weights of a real model's shapes (no such checkpoint ships on PyPI).

    python benchmarks/recurrent_step.py [--models qwen3.5 lfm2 granite4h qwen3] [--batch 1 8 32]
        [--prompt 512] [--steps 20] [--dtype bfloat16] [--profile]

Each model is saved once to a temporary folder (bfloat16 safetensors) and loaded the way the server loads it;
the engine step runs by hand as benchmarks/decode_step.py runs it (scheduler -> ModelRunner.prepare -> execute
-> greedy sample -> update). Per model and batch size it prints the prefill time of the batch's prompts (whole
prompts, one step each up to 8,192 tokens), the median decode step and its tokens per second, and the share of
a decode step spent in the recurrent layers' mixers (timed with forward hooks). ``--profile`` adds a
torch.profiler table of a few decode steps.

The shapes (hidden width, layers, heads, layer pattern) are the published configs' of Qwen3.5-0.8B-class,
LFM2-350M-class and Granite-4.0-H-350M-class models as far as this script states them below; the vocabulary
is cut to 32,768 for all of them (the LM head's share would otherwise dominate at small widths).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import core_pytorch_backend  # noqa: F401  (before torch work: large tensors on huge pages, as the server has them)

sys.path.insert(0, str(Path(__file__).parent))
from decode_step import finish, profile, step  # noqa: E402

VOCAB = 32768
MODELS = {
    # 24 layers, 3 gated-DeltaNet layers to 1 gated attention layer
    "qwen3.5": ("Qwen3_5TextConfig", dict(
        hidden_size=1024, num_hidden_layers=24, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6)),
    # 16 layers: 10 short-convolution blocks, 6 attention layers
    "lfm2": ("Lfm2Config", dict(
        hidden_size=1024, num_hidden_layers=16, intermediate_size=6656, num_attention_heads=16, num_key_value_heads=8,
        layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)])),
    # 32 layers: 28 Mamba-2 layers, 4 attention layers, dense MLPs
    "granite4h": ("GraniteMoeHybridConfig", dict(
        hidden_size=768, num_hidden_layers=32, intermediate_size=2048, shared_intermediate_size=2048,
        num_local_experts=0, num_experts_per_tok=0, num_attention_heads=12, num_key_value_heads=4, mamba_n_heads=48,
        mamba_d_head=32, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
        position_embedding_type="nope",
        layer_types=["attention" if i in (10, 13, 17, 27) else "mamba" for i in range(32)])),
    # the transformer beside them: Qwen3-0.6B's shapes
    "qwen3": ("Qwen3Config", dict(
        hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128)),
}


def save_random(name: str, folder: Path) -> tuple[Path, int]:
    import transformers

    from core_pytorch_backend.testing import tiny_tokenizer

    cls_name, shape = MODELS[name]
    config = getattr(transformers, cls_name)(vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=8192,
                                             **shape)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out = folder / name
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out, model.num_parameters()


def build(path: Path, dtype: str, max_seqs: int):
    from core.scheduling import BlockManager, Scheduler, StateSlots
    from core_pytorch_backend.kernels import select_ops
    from core_pytorch_backend.loader import load_checkpoint
    from core_pytorch_backend.model_runner import ModelRunner, kv_cache_blocks
    from core_pytorch_backend.native_decode import make_native_decode

    loaded = load_checkpoint(path, dtype=dtype, ops=select_ops("cpu"))
    cpu = torch.device("cpu")
    blocks = kv_cache_blocks(loaded.model, 16, loaded.kv_cache_dtype, cpu, 2.0, 0.9)
    runner = ModelRunner(loaded.model, block_size=16, num_blocks=blocks, device=cpu, dtype=loaded.dtype,
                         decode_path=lambda model: make_native_decode(model, device=cpu, enabled=True))
    recurrent = runner.has_recurrent_state
    scheduler = Scheduler(BlockManager(blocks, 16, False), max_num_seqs=max_seqs, max_num_batched_tokens=8192,
                          state_slots=StateSlots() if recurrent else None)
    return runner, scheduler


class MixerClock:
    """Wall time spent inside the model's recurrent layers (forward pre/post hooks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from core_pytorch_backend.layers.recurrent import recurrent_layers

        self.seconds = 0.0
        self._began = 0.0
        for layer in recurrent_layers(model):
            layer.register_forward_pre_hook(self._enter)
            layer.register_forward_hook(self._leave)

    def _enter(self, *_):
        self._began = time.perf_counter()

    def _leave(self, *_):
        self.seconds += time.perf_counter() - self._began


def measure(runner, scheduler, clock: MixerClock, batch: int, prompt_len: int, steps: int, label: str,
            with_profile: bool) -> None:
    from core.scheduling import Sequence

    for i in range(batch):
        scheduler.add(Sequence(f"s{i}", [(97 * i + 31 * j + 11) % (VOCAB - 300) + 50 for j in range(prompt_len)]))
    began = time.perf_counter()
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in scheduler.running + list(scheduler.waiting)):
        step(runner, scheduler)
    prefill = time.perf_counter() - began
    for _ in range(3):
        step(runner, scheduler)
    times: dict[str, list[float]] = {}
    clock.seconds = 0.0
    for _ in range(steps):
        step(runner, scheduler, times)
    median = statistics.median(times["total"])
    mixers = clock.seconds * 1e3 / steps / statistics.mean(times["total"])
    print(f"{label:<10} B={batch:<3} prefill {prefill:6.2f} s ({batch * prompt_len / prefill:7.0f} tok/s); decode step "
          f"{median:7.2f} ms ({batch * 1e3 / median:6.0f} tok/s); recurrent mixers {mixers:4.0%} of a step", flush=True)
    if with_profile:
        profile(runner, scheduler, 3, runner.model.num_layers)
    finish(scheduler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    print(f"# {args.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, prompts of {args.prompt} tokens, vocabulary {VOCAB}")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            checkpoint, parameters = save_random(name, Path(folder))
            runner, scheduler = build(checkpoint, args.dtype, max(args.batch))
            clock = MixerClock(runner.model)
            path = "native decode stack" if runner.decode_path is not None else "modules"
            print(f"{name}: {parameters / 1e6:.0f} M parameters, decode steps through the {path}", flush=True)
            for batch in args.batch:
                measure(runner, scheduler, clock, batch, args.prompt, args.steps, name, args.profile)


if __name__ == "__main__":
    main()
