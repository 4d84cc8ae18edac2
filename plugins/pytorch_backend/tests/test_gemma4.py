"""Gemma 4 on the pytorch backend: greedy parity with transformers' generate (one sequence, a batch of
different lengths past the sliding window, chunked prefill) and logits parity on tiny random checkpoints in
the layouts of the released ones (E2B / E4B: per-layer inputs, KV-shared layers with double-wide MLPs; 31B:
values that are the keys; 26B-A4B: experts beside the MLP), the vision-language checkpoint's language model,
the per-layer KV caches through the engine, and the settings refused at load."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.response import collect
from core.testing.contract import assert_idle, wait_idle
from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.backend import PytorchBackend
from core_pytorch_backend.kernels import reference
from core_pytorch_backend.layers import Attention, allocate_kv_caches, bind_kv_caches, unbind_kv_caches
from core_pytorch_backend.loader import load_checkpoint
from core_pytorch_backend.model_runner import kv_bytes_per_block
from core_pytorch_backend.models.gemma4 import Gemma4ForCausalLM, rope_settings
from core_pytorch_backend.testing import (
    TINY_VOCAB,
    hf_greedy,
    paged_greedy,
    random_prompts,
    reinit_,
    tiny_tokenizer,
)

S, F = "sliding_attention", "full_attention"
ROPE = {S: {"rope_type": "default", "rope_theta": 10000.0},
        F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=6,
              max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=257, eos_token_id=258,
              pad_token_id=259, final_logit_softcapping=30.0, rope_parameters=ROPE,
              hidden_size_per_layer_input=0, vocab_size_per_layer_input=TINY_VOCAB)
CONFIGS = {
    # E2B's layout: per-layer inputs, one KV head, the last 3 layers reading the KV caches of layers 1 and 2
    # (the last of their types before them, not the first) with MLPs twice as wide
    "ple-kv-shared-double-wide": dict(num_hidden_layers=6, layer_types=[S, S, F, S, S, F],
                                      num_key_value_heads=1, hidden_size_per_layer_input=8,
                                      num_kv_shared_layers=3, use_double_wide_mlp=True),
    # 31B's: global layers' values are their keys, one global KV head; untied, with biases
    "k-eq-v": dict(num_hidden_layers=4, layer_types=[S, F, S, F], attention_k_eq_v=True,
                   num_global_key_value_heads=1, tie_word_embeddings=False, attention_bias=True),
    # 26B-A4B's: 4 experts of 32 beside every MLP, two a token
    "moe": dict(num_hidden_layers=3, layer_types=[S, S, F], attention_k_eq_v=True,
                num_global_key_value_heads=1, enable_moe_block=True, num_experts=4, top_k_experts=2,
                moe_intermediate_size=32),
}
PLACEHOLDERS = dict(image_token_id=250, video_token_id=251, audio_token_id=252)
NEW_TOKENS = 10  # past the window of 6 from every prompt


def _text_config(name: str, **overrides):
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(**{**COMMON, **CONFIGS[name], **overrides})


def _reinit(model: torch.nn.Module) -> None:
    """``reinit_``, then each layer's scalar, the router's scales and its logits far from 1 / 0.1 / 0 (where a
    wrong layer scalar, expert scale or router input would not change the tokens)."""
    reinit_(model)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("layer_scalar", "router.scale", "router.per_expert_scale")):
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=gen))
            elif name.endswith("router.proj.weight"):
                tensor.mul_(10)


def _save(model: torch.nn.Module, folder: Path) -> Path:
    _reinit(model)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_text_config(request.param), dtype=torch.float32)
    path = _save(model, tmp_path_factory.mktemp(f"gemma4-{request.param}"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load_checkpoint(path, dtype="float32").model, hf, path


def _last_logits(model, prompt: list[int]) -> torch.Tensor:
    allocate_kv_caches(model, 8, 4)
    meta = AttentionMetadata.build([0], [len(prompt)], [[2, 0, 7, 3, 5]], 4)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(prompt), meta.positions(), meta))
    unbind_kv_caches(model)
    return logits


def test_single_sequence_matches_transformers(pair):
    ours, hf, _ = pair
    (prompt,) = random_prompts([9])
    assert paged_greedy(ours, [prompt], NEW_TOKENS, block_size=16)[0] == hf_greedy(hf, prompt, NEW_TOKENS)


def test_batched_varlen_prefill_then_decode(pair):
    ours, hf, _ = pair
    prompts = random_prompts([3, 13, 1, 8], seed=2)
    got = paged_greedy(ours, prompts, NEW_TOKENS, block_size=4)
    assert got == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def test_chunked_prefill_with_cached_prefix(pair):
    ours, hf, _ = pair
    prompts = random_prompts([14, 7], seed=3)
    got = paged_greedy(ours, prompts, NEW_TOKENS, block_size=4, prefill_chunks=3)
    assert got == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def test_logits_match_transformers(pair):
    """Greedy tokens cannot see a soft cap or a scale of the logits; sampling and logprobs do."""
    ours, hf, _ = pair
    (prompt,) = random_prompts([17], seed=5)
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_last_logits(ours, prompt), expected, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory) -> Path:
    """A Gemma4ForConditionalGeneration checkpoint: a text model with per-layer inputs beside tiny vision and
    audio towers (and their embedders), which the backend skips."""
    import transformers

    text = {**COMMON, "num_hidden_layers": 2, "layer_types": [S, F], "hidden_size_per_layer_input": 8}
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    audio = transformers.Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           subsampling_conv_channels=[8, 4], output_proj_dims=32)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision.to_dict(),
                                       audio_config=audio.to_dict(), boi_token_id=253, eoi_token_id=254,
                                       boa_token_id=255, eoa_token_index=256, **PLACEHOLDERS)
    torch.manual_seed(0)
    return _save(transformers.Gemma4ForConditionalGeneration(config), tmp_path_factory.mktemp("gemma4-vl"))


def test_vision_language_checkpoint_serves_its_language_model(vl_checkpoint):
    """The towers skipped at load; placeholder tokens in a text-only prompt read as the pad token."""
    import transformers

    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(vl_checkpoint, dtype=torch.float32)
    hf.eval()
    ours = load_checkpoint(vl_checkpoint, dtype="float32").model
    assert type(ours).__name__ == "Gemma4ForConditionalGeneration"
    prompt = [5, 17, *PLACEHOLDERS.values(), 3, 44, 7, 9, 10, 11]
    with torch.inference_mode():
        expected = hf(input_ids=torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_last_logits(ours, prompt), expected, rtol=1e-4, atol=1e-4)


def test_images_are_refused_before_and_at_the_model(vl_checkpoint):
    """No vision processor serves the architecture, so the engine refuses images (as for any text-only
    model); image embeddings reaching the model anyway are refused too."""
    from core.plugins import get_plugins
    from core.resolve import find_vision_processor

    assert find_vision_processor(get_plugins(), "Gemma4ForConditionalGeneration", str(vl_checkpoint)) is None
    ours = load_checkpoint(vl_checkpoint, dtype="float32").model
    allocate_kv_caches(ours, 4, 4)
    meta = AttentionMetadata.build([0], [3], [[0]], 4)
    with pytest.raises(NotImplementedError, match="image and audio embeddings"):
        ours(torch.tensor([5, 250, 6]), meta.positions(), meta, (torch.tensor([1]), torch.ones(1, 64)))


def test_kv_caches_differ_by_layer_and_shared_layers_read_their_source():
    """Layers 0-2 own caches of their own widths (16, 16, 32); 3 and 4 read layer 1's, 5 layer 2's."""
    model = Gemma4ForCausalLM(_text_config("ple-kv-shared-double-wide"), reference)
    caches = allocate_kv_caches(model, 5, 4)
    assert [tuple(k.shape) for k, _ in caches] == [(5, 4, 1, 16), (5, 4, 1, 16), (5, 4, 1, 32)]
    attention = [layer.self_attn.attn for layer in model.model.layers]
    for layer, source in ((3, 1), (4, 1), (5, 2)):
        assert attention[layer].k_cache is caches[source][0] and attention[layer].v_cache is caches[source][1]
    assert kv_bytes_per_block(model, 4, torch.float32) == 2 * 4 * 4 * (16 + 16 + 32)
    reader = torch.nn.ModuleList([Attention(2, 1, 16, 1.0, reference, layer_index=1, kv_source=0)])
    with pytest.raises(ValueError, match="reads the KV cache of layer 0, which owns none"):
        bind_kv_caches(reader, [])


@pytest.mark.parametrize("pair", ["ple-kv-shared-double-wide"], indirect=True)
async def test_engine_greedy_parity_with_per_layer_caches(pair):
    """Through the runner: its cache of layers of two widths and of shared layers (zeroed as reached), prefill
    chunks and 6 sequences at once."""
    _, hf, path = pair
    backend = PytorchBackend(EngineConfig(model=str(path), dtype="float32", kv_cache_memory_gib=0.01,
                                          block_size=4, max_num_batched_tokens=24))
    engine = AsyncEngine(backend)
    greedy = GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    try:
        prompts = random_prompts([5, 19, 2, 11, 30, 8], seed=4)
        together = await asyncio.gather(*(collect(engine.generate(p, greedy)) for p in prompts))
        assert [r.token_ids for r in together] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        assert_idle(engine, await wait_idle(engine))
    finally:
        await engine.close()


def test_proportional_rope_is_transformers():
    """The global layers' frequencies: the head's first quarter at base ** (-2i / head_dim), the rest 0."""
    from transformers import Gemma4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from core_pytorch_backend.layers.rotary import compute_inv_freq

    rope = {**ROPE, F: {**ROPE[F], "factor": 2.0}}
    config = Gemma4TextConfig(**{**COMMON, **CONFIGS["k-eq-v"], "rope_parameters": rope})
    theirs, _ = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu", layer_type=F)
    ours = compute_inv_freq(32, rope_settings(config, F, 32))
    assert torch.equal(ours, theirs) and theirs[4:].eq(0).all() and theirs[:4].ne(0).all()


@pytest.mark.parametrize(("overrides", "field"), [
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(rope_parameters={**ROPE, F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}),
     r"rope_parameters\['full_attention'\] rope_type 'linear'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "rope_parameters without"),
    (dict(num_kv_shared_layers=4), "num_kv_shared_layers"),
    (dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=100), "vocab_size_per_layer_input"),
])
def test_unsupported_settings_are_named(overrides, field):
    with pytest.raises(NotImplementedError, match=field):
        Gemma4ForCausalLM(_text_config("k-eq-v", **overrides), reference)
