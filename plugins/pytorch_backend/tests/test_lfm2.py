"""LFM2, LFM2-MoE and LFM3 (Liquid AI's hybrids of short convolutions and attention) on the pytorch backend:
greedy parity with transformers' generate (one sequence, a batch of different lengths, chunked prefill, prefill
in chunks shorter than the convolution) and logits parity on tiny random checkpoints, config variants the
real checkpoints use, LFM2-MoE's router against transformers' own, an LFM2 GGUF file (llama.cpp's layout) against
the checkpoint it was written from, and the layouts refused at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core_pytorch_backend.loader import load_checkpoint
from core_pytorch_backend.testing import (
    TINY_VOCAB,
    assert_greedy_matches,
    assert_logits_close,
    built_once,
    finish_gguf,
    gguf_writer,
    hf_greedy,
    ours_and_transformers,
    paged_greedy,
    prompt_logits,
    random_prompts,
    reinit_,
    tiny_tokenizer,
)

COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, norm_eps=1e-6, bos_token_id=257,
              eos_token_id=258, pad_token_id=259)
CONV_ATTN = ["conv", "full_attention", "conv", "full_attention"]

# name -> (config class name, overrides)
CONFIGS = {
    # LFM2-1.2B's MLP rule at a tiny size: 2/3 of 128, times 1.0, rounded up to 32 -> 96
    "lfm2": ("Lfm2Config", dict(layer_types=CONV_ATTN, block_multiple_of=32)),
    # LFM2-8B-A1B's layout: a dense first layer, then 4 experts of 32 (two a token) behind the biased sigmoid router
    "lfm2_moe": ("Lfm2MoeConfig", dict(layer_types=CONV_ATTN, num_dense_layers=1, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=32)),
    # LFM3-1.7B's layout: 7-tap convolutions, a sliding layer (window 6) and a full one (proportional rotary on half
    # of each head), gated heads, sandwich norms
    "lfm3": ("Lfm3Config", dict(layer_types=["conv", "sliding_attention", "conv", "full_attention"], head_dim=16,
                                sliding_window=6)),
}
FAMILIES = tuple(CONFIGS)
VARIANTS = {
    # the older configs' full_attn_idxs; biases on the convolution and its projections; an untied head; 4 taps;
    # the MLP as intermediate_size says
    "lfm2-attn-idxs-conv-bias-untied-4-taps": ("Lfm2Config", dict(
        layer_types=None, full_attn_idxs=[1], conv_bias=True, tie_word_embeddings=False, conv_L_cache=4,
        block_auto_adjust_ff_dim=False)),
    # 2/3 of the width times 1.3, rounded up to 16: 112
    "lfm2-auto-ff-dim-multiplier": ("Lfm2Config", dict(layer_types=CONV_ATTN, block_ffn_dim_multiplier=1.3,
                                                       block_multiple_of=16)),
    # no expert bias, weights neither normalized nor at scale 1, three experts a token on every layer
    "lfm2-moe-unbiased-unnormalized-scaled": ("Lfm2MoeConfig", dict(
        layer_types=CONV_ATTN, num_dense_layers=0, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=32,
        use_expert_bias=False, norm_topk_prob=False, routed_scaling_factor=2.5, tie_word_embeddings=False)),
    # neither gate nor sandwich norms; q/k/v/o and convolution biases; default rotary on both layer types, window 4
    "lfm3-ungated-unsandwiched-biases-default-rope": ("Lfm3Config", dict(
        layer_types=["conv", "full_attention", "sliding_attention", "conv"], head_dim=16, sliding_window=4,
        use_attention_gate=False, use_sandwich_norm=False, attention_bias=True, conv_bias=True, conv_L_cache=3,
        tie_word_embeddings=False, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}


def _config(cls_name: str, overrides: dict):
    import transformers

    return getattr(transformers, cls_name)(**{**COMMON, **overrides})


def _build(cls_name: str, overrides: dict, folder: Path) -> Path:
    """A tiny random checkpoint: weights of std 0.2, the convolutions' taps of 0.5 (so that they move the
    tokens), the experts' choice biases about as large as the sigmoid scores (so that they change the choice)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(cls_name, overrides), dtype=torch.float32)
    reinit_(model, std=0.2)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("conv.conv.weight"):
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.5)
            elif name.endswith("expert_bias"):
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.3)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return built_once(tmp_path_factory, lambda name, folder: _build(*{**CONFIGS, **VARIANTS}[name], folder))


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, checkpoint):
    return ours_and_transformers(checkpoint(request.param))


def test_single_sequence_matches_transformers(pair):
    assert_greedy_matches(pair, [9], block_size=16)


def test_batched_varlen_prefill_then_decode(pair):
    assert_greedy_matches(pair, [3, 13, 1, 8], seed=2)


def test_chunked_prefill_continues_the_state(pair):
    assert_greedy_matches(pair, [14, 7], seed=3, prefill_chunks=3)


def test_prefill_chunks_shorter_than_the_convolution(pair):
    """Chunks of 1-2 tokens: each continues from inputs kept in the state over several earlier chunks."""
    assert_greedy_matches(pair, [11, 17], seed=4, prefill_chunks=9)


@torch.inference_mode()
def test_logits_match_transformers(pair):
    ours, hf = pair
    (prompt,) = random_prompts([13], seed=5)
    assert_logits_close(prompt_logits(ours, prompt), hf(torch.tensor([prompt])).logits[0])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_match_transformers(variant, checkpoint):
    ours, hf = ours_and_transformers(checkpoint(variant))
    prompts = random_prompts([23, 6], seed=7)
    assert paged_greedy(ours, prompts, block_size=4, prefill_chunks=2) == [hf_greedy(hf, p) for p in prompts]


def test_mlp_widths_follow_the_config(checkpoint):
    """LFM2's reshaped width; LFM2-MoE's dense first layer and LFM3's as given."""
    from core_pytorch_backend.models.llama import LlamaMLP

    def widths(name):
        layers = load_checkpoint(checkpoint(name), dtype="float32").model.model.layers
        return [m.down_proj.input_size if isinstance(m, LlamaMLP) else None for m in (x.feed_forward for x in layers)]

    assert widths("lfm2") == [96] * 4
    assert widths("lfm2-auto-ff-dim-multiplier") == [112] * 4
    assert widths("lfm2_moe") == [128, None, None, None] and widths("lfm3") == [128] * 4


@pytest.mark.parametrize("name", ["lfm2_moe", "lfm2-moe-unbiased-unnormalized-scaled"])
@torch.inference_mode()
def test_router_matches_transformers(name, checkpoint):
    ours, hf = ours_and_transformers(checkpoint(name))
    hidden = torch.randn(64, COMMON["hidden_size"], generator=torch.Generator().manual_seed(0))
    block = hf.model.layers[1].feed_forward
    _, hf_weights, hf_chosen = block.gate(hidden, block.expert_bias if block.use_expert_bias else None)
    weights, chosen = ours.model.layers[1].feed_forward.routing(hidden)
    assert torch.equal(chosen, hf_chosen) and torch.equal(weights, hf_weights)


REFUSED = {
    "lfm2-unknown-layer-type": ("Lfm2Config", dict(layer_types=["conv", "sliding_attention", "conv", "conv"]),
                                "layer_types"),
    "lfm2-moe-without-layer-types": ("Lfm2MoeConfig", dict(layer_types=None), "layer_types"),
    # transformers' LFM2 turns whole heads: it ignores the factor with the default frequencies (served so) and
    # fails with it with any other
    "lfm2-partial-rotary-linear": ("Lfm2Config", dict(layer_types=CONV_ATTN, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        "partial_rotary_factor"),
    "lfm3-yarn": ("Lfm3Config", dict(head_dim=16, rope_parameters={
        "full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), "rope_type"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_layouts_it_does_not_run_are_refused_at_load(name, tmp_path):
    cls_name, overrides, field = REFUSED[name]
    _config(cls_name, overrides).save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match=field):
        load_checkpoint(tmp_path, dtype="float32")


def _lfm2_gguf(hf_folder: Path, tokenizer_source: Path, target: Path) -> Path:
    """A float32 GGUF of the LFM2 checkpoint in ``hf_folder`` as llama.cpp's converter writes one: attention layers
    named by their KV head counts (0 for a convolution), the taps [channels, taps]; the tokenizer fields of the
    GGUF ``tokenizer_source``."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_folder)
    writer = gguf_writer(target, "lfm2", config, tokenizer_source)
    writer.add_head_count_kv([0 if t == "conv" else config.num_key_value_heads for t in config.layer_types])
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_shortconv_l_cache(config.conv_L_cache)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, config.num_hidden_layers)
    for name, tensor in load_file(hf_folder / "model.safetensors").items():
        tensor = tensor[:, 0] if name.endswith("conv.conv.weight") else tensor
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    return finish_gguf(writer, target)


@pytest.mark.slow
def test_an_lfm2_gguf_matches_transformers_on_its_checkpoint(default_gguf_path, tmp_path):
    """transformers' GGUF mapping reads the attention layers from the per-layer KV head counts and the MLP width
    as stored (``block_auto_adjust_ff_dim`` off); the file (the default model's vocabulary, for its tokenizer
    fields) then continues prompts as transformers does on the checkpoint it was written from."""
    from transformers import AutoModelForCausalLM

    overrides = dict(CONFIGS["lfm2"][1], vocab_size=49152, block_auto_adjust_ff_dim=False)
    hf_folder = _build("Lfm2Config", overrides, tmp_path / "hf")
    path = _lfm2_gguf(hf_folder, default_gguf_path, tmp_path / "tiny-lfm2.gguf")
    ours = load_checkpoint(path, dtype="float32", quantization="none", cache_dir=tmp_path / "cache").model
    hf = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    prompts = random_prompts([14, 7], seed=3)
    assert paged_greedy(ours, prompts, block_size=4, prefill_chunks=3) == [hf_greedy(hf, p) for p in prompts]
