"""Gemma 3 on the pytorch backend: greedy parity of the text decoder with transformers (sliding and
global layers, chunked prefill, continuous batching), its Gemma-specific pieces against transformers'
modules, and the bidirectional image spans of the reference attention op."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.response import collect
from core.testing.contract import assert_idle, wait_idle
from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.backend import PytorchBackend
from core_pytorch_backend.kernels import reference, select_ops
from core_pytorch_backend.models.gemma3 import GemmaRMSNorm, rope_parameters_by_layer_type

NEW_TOKENS = 10
GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts(count: int) -> list[list[int]]:
    """Lengths 3 to 45: most are longer than the sliding window (8) and the step budget (32)."""
    return [[(13 * i + 5 * j + 1) % 250 for j in range(3 + (7 * i) % 43)] for i in range(count)]


def _reference_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def gemma3_path(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("gemma3_text")


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gemma3_path), dtype=torch.float32).eval()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    model.generation_config.eos_token_id = None
    return model


async def test_greedy_parity_single_and_8_concurrent(gemma3_path, hf_gemma3):
    backend = PytorchBackend(EngineConfig(model=str(gemma3_path), dtype="float32", kv_cache_memory_gib=0.01,
                                          block_size=4, max_num_batched_tokens=32))
    assert backend.model_info.architecture == "Gemma3ForCausalLM"
    engine = AsyncEngine(backend)
    try:
        prompts = _prompts(8)
        single = await collect(engine.generate(prompts[3], GREEDY))
        assert single.token_ids == _reference_greedy(hf_gemma3, prompts[3])
        together = await asyncio.gather(*(collect(engine.generate(p, GREEDY)) for p in prompts))
        for prompt, response in zip(prompts, together, strict=True):
            assert response.token_ids == _reference_greedy(hf_gemma3, prompt), prompt
        assert_idle(engine, await wait_idle(engine))
    finally:
        await engine.close()


def test_bfloat16_logits_follow_transformers(gemma3_path):
    """bfloat16: the norms compute in float32 and round once, the embedding scale is rounded first."""
    from transformers import AutoModelForCausalLM

    from core_pytorch_backend.layers.attention import allocate_kv_caches
    from core_pytorch_backend.loader import load_checkpoint

    hf = AutoModelForCausalLM.from_pretrained(str(gemma3_path), dtype=torch.bfloat16).eval()
    ours = load_checkpoint(gemma3_path, dtype="bfloat16").model
    allocate_kv_caches(ours, 16, 4)
    prompt = _prompts(8)[6]
    meta = AttentionMetadata.build([0], [len(prompt)], [list(range(16))], 4)
    with torch.inference_mode():
        logits = ours.compute_logits(ours(torch.tensor(prompt), meta.positions(), meta))
        want = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(logits, want, atol=0.1, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_gemma3_norm(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 3, 32, generator=gen) * 3).to(dtype)
    theirs = Gemma3RMSNorm(32, eps=1e-6)
    ours = GemmaRMSNorm(32, 1e-6, select_ops("cpu", kind="reference"))
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(32, generator=gen))
        ours.weight.copy_(theirs.weight)
        theirs, ours = theirs.to(dtype), ours.to(dtype)
        assert torch.equal(ours(x), theirs(x))
        residual = torch.randn(5, 3, 32, generator=gen).to(dtype)
        normed, summed = ours(x, residual)
        assert torch.equal(summed, x + residual) and torch.equal(normed, theirs(x + residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_is_transformers_gelu_pytorch_tanh(dtype):
    from transformers.activations import ACT2FN

    from core_pytorch_backend.layers import get_act_and_mul

    x = torch.randn(7, 2 * 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    layer = get_act_and_mul("gelu_pytorch_tanh", select_ops("cpu", kind="reference"))
    assert torch.equal(layer(x), ACT2FN["gelu_pytorch_tanh"](gate) * up)
    with pytest.raises(NotImplementedError, match="hidden_act 'tanh' is not supported"):
        get_act_and_mul("tanh", reference)


def test_triton_set_has_every_op_including_gelu_tanh():
    pytest.importorskip("triton")
    triton_ops = select_ops("cuda" if torch.cuda.is_available() else "cpu", kind="triton")
    x = torch.randn(3, 16)
    assert torch.equal(triton_ops.gelu_tanh_and_mul(x), reference.gelu_tanh_and_mul(x))


@pytest.mark.parametrize("field", ["use_bidirectional_attention"])  # soft-capped scores are served (Gemma 2)
def test_unsupported_config_fields_are_named(field):
    from transformers import Gemma3TextConfig

    from core_pytorch_backend.models.gemma3 import Gemma3ForCausalLM

    config = Gemma3TextConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                              **{field: 50.0 if field == "attn_logit_softcapping" else True})
    with pytest.raises(NotImplementedError, match=field):
        Gemma3ForCausalLM(config, reference)


def test_rope_parameters_per_layer_type_old_and_new_configs():
    new = SimpleNamespace(rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    old = SimpleNamespace(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
                          rope_local_base_freq=1e4)
    for config in (new, old):
        params = rope_parameters_by_layer_type(config)
        assert params["full_attention"]["rope_type"] == "linear" and params["full_attention"]["factor"] == 8.0
        assert params["full_attention"]["rope_theta"] == 1e6
        assert params["sliding_attention"]["rope_type"] == "default"
        assert params["sliding_attention"]["rope_theta"] == 1e4


# ---------------------------------------------------------------- bidirectional spans in the attention op

SEQ_LEN, BLOCK, HQ, HKV, D = 20, 4, 4, 2, 8
SPANS = ((3, 13), (15, 18))


def _filled_cache(gen: torch.Generator):
    """K/V of SEQ_LEN tokens in a shuffled paged cache, and the dense K/V [L, Hkv, D]."""
    k, v = torch.randn(SEQ_LEN, HKV, D, generator=gen), torch.randn(SEQ_LEN, HKV, D, generator=gen)
    table = [4, 0, 6, 2, 5]
    k_cache, v_cache = torch.zeros(8, BLOCK, HKV, D), torch.zeros(8, BLOCK, HKV, D)
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(SEQ_LEN)])
    reference.store_kv_cache(k, v, k_cache, v_cache, slots)
    return k, v, k_cache, v_cache, table


def _dense_oracle(q, k, v, window):
    """transformers' Gemma 3 mask: (causal | same image) & window, as one dense SDPA."""
    pos, j = torch.arange(SEQ_LEN)[:, None], torch.arange(SEQ_LEN)[None, :]
    mask = j <= pos
    for start, end in SPANS:
        mask |= (pos >= start) & (pos < end) & (j >= start) & (j < end)
    if window is not None:
        mask &= j > pos - window
    group = HQ // HKV
    kk, vv = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    return F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=0.3).transpose(0, 1)


def _run(q, k_cache, v_cache, table, chunks, window, spans=SPANS):
    """The reference op over consecutive chunks [(start, end)] of the sequence; outputs concatenated."""
    outs = []
    for start, end in chunks:
        meta = AttentionMetadata.build([start], [end - start], [table], BLOCK)
        meta.bidirectional_spans = [spans]
        outs.append(reference.paged_attention(q[start:end], k_cache, v_cache, meta, 0.3, window))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 4], ids=["global", "window_4_inside_a_10_token_image"])
@pytest.mark.parametrize("chunks", [[(0, 20)], [(0, 3), (3, 15), (15, 18), (18, 19), (19, 20)],
                                    [(8, 13), (13, 20)]],
                         ids=["whole", "chunks_at_span_starts", "resume_inside_a_span"])
def test_spans_attend_both_ways(window, chunks):
    """Chunks may start inside a span (a prefix-cache hit); the KV before them is already final."""
    gen = torch.Generator().manual_seed(3)
    k, v, k_cache, v_cache, table = _filled_cache(gen)
    q = torch.randn(SEQ_LEN, HQ, D, generator=gen)
    want = _dense_oracle(q, k, v, window)
    got = _run(q, k_cache, v_cache, table, chunks, window)
    first = chunks[0][0]
    torch.testing.assert_close(got, want[first:], atol=1e-5, rtol=1e-5)
    causal = _run(q, k_cache, v_cache, table, chunks, window, spans=())
    assert not torch.allclose(causal, want[first:], atol=1e-3)  # the spans changed the image rows


def test_a_chunk_ending_inside_a_span_is_an_error():
    gen = torch.Generator().manual_seed(4)
    _, _, k_cache, v_cache, table = _filled_cache(gen)
    q = torch.randn(SEQ_LEN, HQ, D, generator=gen)
    with pytest.raises(RuntimeError, match=r"inside the bidirectional span \[3, 13\)"):
        _run(q, k_cache, v_cache, table, [(0, 8)], None)


def test_triton_paged_attention_with_spans_is_the_reference():
    pytest.importorskip("triton")
    triton_ops = select_ops("cpu", kind="triton")
    gen = torch.Generator().manual_seed(5)
    _, _, k_cache, v_cache, table = _filled_cache(gen)
    q = torch.randn(SEQ_LEN, HQ, D, generator=gen)
    meta = AttentionMetadata.build([0], [SEQ_LEN], [table], BLOCK)
    meta.bidirectional_spans = [SPANS]
    want = reference.paged_attention(q, k_cache, v_cache, meta, 0.3, 4)
    assert torch.equal(triton_ops.paged_attention(q, k_cache, v_cache, meta, 0.3, 4), want)
