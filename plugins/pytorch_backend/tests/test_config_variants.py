"""Config variants real checkpoints may carry, found by benchmarks/parity_sweep.py to diverge from transformers'
greedy output (float32): each case failed before its fix. Refusals: a config we cannot serve as transformers
runs it is refused at load, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from core_pytorch_backend.loader import load_checkpoint
from core_pytorch_backend.testing import (
    TINY_VOCAB,
    hf_greedy,
    ours_and_transformers,
    paged_greedy,
    random_prompts,
    save_tiny_checkpoint,
)

# the sizes of conftest's tiny_config, for the families it does not build (arch names as transformers' classes)
COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=257,
              eos_token_id=258, pad_token_id=259)


def _rope(rope_type: str = "default", partial: float = 1.0, **extra) -> dict:
    return {"rope_type": rope_type, "rope_theta": 10000.0, "partial_rotary_factor": partial, **extra}


# name -> (arch, config overrides)
VARIANTS = {
    # transformers' Llama-family rotary turns whole heads: its default frequencies ignore partial_rotary_factor
    # (only GPT-NeoX, Phi, Phi-3, StableLM, GLM, Nemotron, Bamba and Qwen3-Next read it); core turned a part
    "llama-partial-rotary-factor-ignored": ("llama", dict(rope_parameters=_rope(partial=0.5))),
    "olmo-partial-rotary-factor-ignored": ("olmo", dict(rope_parameters=_rope(partial=0.75))),
    "qwen3-moe-partial-rotary-factor-ignored": ("qwen3_moe", dict(rope_parameters=_rope(partial=0.5))),
    # (Cohere and Falcon refused it; transformers serves it as above)
    "cohere-partial-rotary-factor-ignored": ("cohere", dict(rope_parameters=_rope(partial=0.75))),
    "falcon-partial-rotary-factor-ignored": ("falcon", dict(rope_parameters=_rope(partial=0.5))),
    "phimoe-partial-rotary-factor-ignored": ("PhimoeConfig", dict(
        rope_parameters=_rope(partial=0.5), num_local_experts=4, num_experts_per_tok=2)),
    "olmo-hybrid-partial-rotary-factor-ignored": ("OlmoHybridConfig", dict(
        num_hidden_layers=4, intermediate_size=96, rope_parameters=_rope(partial=0.5),
        layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8)),
    "lfm2-partial-rotary-factor-ignored": ("Lfm2Config", dict(  # (refused before)
        num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2, norm_eps=1e-6, block_multiple_of=32,
        rope_parameters=_rope(partial=0.5))),
    # PhiMoE's sparsemixer picks two experts a token whatever num_experts_per_tok says, as transformers' (refused)
    "phimoe-num-experts-per-tok-ignored": ("PhimoeConfig", dict(num_local_experts=4, num_experts_per_tok=1)),
    # the families that read partial_rotary_factor still turn a part
    "glm4-partial-rotary-factor-read": ("glm4", dict(rope_parameters=_rope(partial=0.25))),
    "stablelm-partial-rotary-factor-read": ("stablelm", dict(rope_parameters=_rope(partial=0.5))),
}


def checkpoint(arch: str, overrides: dict, factory, folder: Path) -> Path:
    """conftest's tiny ``arch``, or (a transformers config class's name) one of COMMON's sizes, with ``overrides``."""
    if arch.endswith("Config"):
        return save_tiny_checkpoint(getattr(transformers, arch)(**{**COMMON, **overrides}), folder)
    return factory(arch, **overrides)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variant_matches_transformers(variant, tiny_checkpoint_factory, tmp_path):
    arch, overrides = VARIANTS[variant]
    ours, hf = ours_and_transformers(checkpoint(arch, overrides, tiny_checkpoint_factory, tmp_path))
    prompts = random_prompts([19, 5], seed=11)
    assert paged_greedy(ours, prompts, prefill_chunks=2) == [hf_greedy(hf, p) for p in prompts]


# name -> (arch, config overrides, the field the refusal names)
REFUSED = {
    # transformers' Llama fails on it (cos / sin tables narrower than the heads): no reference to serve it as
    "llama-yarn-partial-rotary": ("llama", dict(rope_parameters=_rope(
        "yarn", 0.5, factor=4.0, original_max_position_embeddings=16)), "partial_rotary_factor"),
}


@pytest.mark.parametrize("variant", list(REFUSED))
def test_config_variant_refused_at_load(variant, tiny_checkpoint_factory, tmp_path):
    arch, overrides, field = REFUSED[variant]
    with pytest.raises(NotImplementedError, match=field):
        load_checkpoint(checkpoint(arch, overrides, tiny_checkpoint_factory, tmp_path), dtype="float32")
