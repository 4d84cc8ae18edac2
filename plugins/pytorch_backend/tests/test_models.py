"""Greedy parity of the built-in models with transformers' generate (float32, CPU), through
core_pytorch_backend.testing's paged driver."""

from __future__ import annotations

import math

import pytest
import torch

from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.layers import allocate_kv_caches, unbind_kv_caches
from core_pytorch_backend.loader import load_checkpoint
from core_pytorch_backend.testing import (
    NEW_TOKENS,
    assert_greedy_matches,
    hf_greedy,
    paged_greedy,
    random_prompts,
)

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "smollm3", "granite", "phi3", "olmo2", "qwen3_moe", "mixtral", "gemma2", "qwen2_moe",
         "gemma", "stablelm", "starcoder2", "gpt_neox", "olmo", "phi", "opt", "gpt2", "internlm3", "ministral", "seed_oss", "helium", "ernie4_5", "arcee", "hunyuan_v1_dense", "olmo3", "exaone4", "olmoe", "granitemoe",
         "granitemoeshared", "glm", "glm4", "cohere", "cohere2", "nemotron", "gptj", "gpt_bigcode", "falcon",
         "ministral3", "apertus", "vaultgemma", "nanochat", "jais2", "persimmon", "codegen",
         "xglm", "biogpt")


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tiny_checkpoint_factory):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint_factory(request.param)
    ours = load_checkpoint(path, dtype="float32").model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


def test_single_sequence_matches_transformers(pair):
    assert_greedy_matches(pair, [9], block_size=16)


def test_batched_varlen_prefill_then_decode(pair):
    assert_greedy_matches(pair, [3, 13, 1, 8], seed=2)


def test_prompts_shorter_than_the_chunks_prefill_in_their_last_ones(pair):
    assert_greedy_matches(pair, [9, 2, 1], seed=4, prefill_chunks=4)  # the short ones' first chunks are empty rows


def test_chunked_prefill_with_cached_prefix(pair):
    assert_greedy_matches(pair, [14, 7], seed=3, prefill_chunks=3)


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 10000.0,
        },
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},  # within max_position_embeddings
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 12, "rope_theta": 500.0,
         "beta_fast": 16, "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.6, "truncate": False},
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 20, "rope_theta": 10000.0,
         "attention_factor": 1.3},
    ],
    ids=["llama3", "linear", "dynamic", "yarn", "yarn-mscale-untruncated", "yarn-attention-factor"],
)
def test_rope_scaling_parity(rope, tiny_checkpoint_factory):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint_factory("llama", rope_parameters=rope)
    ours = load_checkpoint(path, dtype="float32").model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == rope["rope_type"]
    prompts = random_prompts([30, 5], seed=4)
    assert paged_greedy(ours, prompts, block_size=4) == [hf_greedy(hf, p) for p in prompts]


# Config variants real checkpoints of these families use, beyond the tiny defaults above.
VARIANTS = {
    "llama-attention-and-mlp-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-head-dim-apart-from-hidden": ("llama", dict(head_dim=32)),
    "llama-one-kv-head": ("llama", dict(num_key_value_heads=1)),
    "llama-tied-embeddings": ("llama", dict(tie_word_embeddings=True)),
    "llama-no-gqa": ("llama", dict(num_key_value_heads=4)),
    "qwen2-untied": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3-yarn": ("qwen3", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0,
                                                  "original_max_position_embeddings": 16})),
    "qwen3-tied-one-kv-head": ("qwen3", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen3-attention-bias": ("qwen3", dict(attention_bias=True)),
    "mistral-window-4": ("mistral", dict(sliding_window=4)),
    "smollm3-rope-first-and-sliding": ("smollm3", dict(no_rope_layers=[1, 0], use_sliding_window=True,
                                                       sliding_window=5, layer_types=["sliding_attention",
                                                                                      "full_attention"])),
    "smollm3-attention-bias": ("smollm3", dict(attention_bias=True, tie_word_embeddings=False)),
    "phi3-sliding-window": ("phi3", dict(sliding_window=6)),
    # StableLM 2 12B's layout: a LayerNorm per head of q and k, attention and MLP on one input norm
    "stablelm-parallel-qk-layernorm": ("stablelm", dict(use_parallel_residual=True, qk_layernorm=True)),
    "gpt-neox-sequential-residual": ("gpt_neox", dict(use_parallel_residual=False)),
    "olmo-clip-qkv": ("olmo", dict(clip_qkv=0.5)),  # OLMo-7B-0424's clamp, tight enough to bite here
    "phi-qk-layernorm-tied": ("phi", dict(qk_layernorm=True, tie_word_embeddings=True)),  # the head's bias apart
    # rotary on the first 12 of each head's 16 values (Phi-4-mini's 0.75), the rest passed through
    "phi3-partial-rotary": ("phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.75})),
    "qwen3-moe-normalized-top-3-every-layer": ("qwen3_moe", dict(norm_topk_prob=True, num_experts_per_tok=3,
                                                                 mlp_only_layers=[])),
    "seed-oss-o-bias-only": ("seed_oss", dict(attention_bias=False, attention_out_bias=True, mlp_bias=False)),
    "helium-no-biases-tied": ("helium", dict(attention_bias=False, mlp_bias=False, tie_word_embeddings=True)),
    "ernie4_5-no-biases": ("ernie4_5", dict(use_bias=False, tie_word_embeddings=False)),
    # Hunyuan's checkpoints: "dynamic" with a fixed NTK alpha, which transformers applies as a stretched base
    "hunyuan-ntk-alpha": ("hunyuan_v1_dense", dict(rope_parameters={"rope_type": "dynamic", "alpha": 1000.0,
                                                                    "rope_theta": 10000.0, "factor": 1.0})),
    # OLMo 3's long-context recipe: YaRN on the global layers only, another base on the windowed ones
    "olmo3-yarn-global-layers": ("olmo3", dict(rope_parameters={
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                           "rope_theta": 50000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "olmoe-normalized-top-3-unclipped": ("olmoe", dict(norm_topk_prob=True, num_experts_per_tok=3, clip_qkv=None,
                                                        tie_word_embeddings=True)),
    "glm-no-bias-tied-full-rotary": ("glm", dict(attention_bias=False, tie_word_embeddings=True,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                  "partial_rotary_factor": 1.0})),
    "glm4-no-bias-tied": ("glm4", dict(attention_bias=False, tie_word_embeddings=True)),
    # Command R+'s per-head q/k LayerNorms (their weights reordered with the q/k rows)
    "cohere-qk-norm-bias-untied": ("cohere", dict(use_qk_norm=True, attention_bias=True, tie_word_embeddings=False,
                                                  logit_scale=0.25)),
    "cohere2-global-first-bias-untied": ("cohere2", dict(layer_types=["full_attention", "sliding_attention"],
                                                         attention_bias=True, tie_word_embeddings=False,
                                                         logit_scale=0.5)),
    "nemotron-biases-tied-full-rotary": ("nemotron", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                           "partial_rotary_factor": 1.0})),
    "gptj-full-rotary-tied": ("gptj", dict(rotary_dim=16, tie_word_embeddings=True)),
    "gpt-bigcode-multi-head-untied": ("gpt_bigcode", dict(multi_query=False, tie_word_embeddings=False)),
    "gpt-bigcode-unscaled": ("gpt_bigcode", dict(scale_attn_weights=False, attention_softmax_in_fp32=False,
                                                 scale_attention_softmax_in_fp32=False)),
    # Falcon-40B/180B's layout: q/k/v packed per KV group, ln_attn / ln_mlp
    "falcon-40b-new-architecture": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),
    "falcon-new-architecture-one-norm-bias": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2,
                                                             num_ln_in_parallel_attn=1, bias=True)),
    "falcon-new-architecture-kv-heads-4-untied": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=4,
                                                                 tie_word_embeddings=False)),
    "falcon-sequential-bias": ("falcon", dict(parallel_attn=False, bias=True)),
    "falcon-multi-head-rope-theta": ("falcon", dict(multi_query=False, rope_parameters={"rope_type": "default",
                                                                                        "rope_theta": 500.0})),
    # Found by fuzzing configs against transformers: Qwen3-MoE windows every layer (no layer_types) ...
    "qwen3-moe-sliding-window": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=5)),
    # ... Gemma 3's attention ignores attn_logit_softcapping (Gemma 2's applies it) ...
    "gemma3-attention-softcap-ignored": ("gemma3_text", dict(attn_logit_softcapping=5.0)),
    # ... Qwen2-MoE has a qkv_bias field, and builds an empty shared expert of size 0 ...
    "qwen2-moe-no-qkv-bias": ("qwen2_moe", dict(qkv_bias=False)),
    "qwen2-moe-no-shared-expert": ("qwen2_moe", dict(shared_expert_intermediate_size=0)),
    # ... and most families' MLPs have no biases whatever mlp_bias says (Llama's, Granite's, SmolLM3's do)
    "qwen2-mlp-bias-ignored": ("qwen2", dict(mlp_bias=True)),
    "mistral-mlp-bias-ignored": ("mistral", dict(mlp_bias=True)),
    "olmo2-mlp-bias-ignored": ("olmo2", dict(mlp_bias=True)),
    "phi3-mlp-bias-ignored": ("phi3", dict(mlp_bias=True)),
    "qwen3-moe-mlp-bias-ignored": ("qwen3_moe", dict(mlp_bias=True)),
    "granite-mlp-bias": ("granite", dict(mlp_bias=True)),
    "exaone4-no-window": ("exaone4", dict(sliding_window=None, layer_types=["full_attention", "full_attention"],
                                          tie_word_embeddings=True)),
    # Falcon-RW (falcon-rw-1b): ALiBi instead of rotary, sequential layers with biases
    "falcon-rw-alibi": ("falcon", dict(alibi=True, multi_query=False, parallel_attn=False, bias=True)),
    "falcon-alibi-multi-query": ("falcon", dict(alibi=True)),
    # Found by a second fuzz: gpt-neox-20b's gelu_fast, and gated MLPs of activations without an op of their own
    # (transformers' gated MLPs take any ACT2FN name), were refused at load
    "gpt-neox-20b-gelu-fast": ("gpt_neox", dict(hidden_act="gelu_fast")),
    "phi-quick-gelu": ("phi", dict(hidden_act="quick_gelu")),
    "llama-gated-gelu": ("llama", dict(hidden_act="gelu")),
    "qwen3-gated-relu": ("qwen3", dict(hidden_act="relu")),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_match_transformers(variant, tiny_checkpoint_factory):
    from transformers import AutoModelForCausalLM

    arch, overrides = VARIANTS[variant]
    path = tiny_checkpoint_factory(arch, **overrides)
    ours = load_checkpoint(path, dtype="float32").model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts([23, 6], seed=7)
    assert paged_greedy(ours, prompts, block_size=4, prefill_chunks=2) == [hf_greedy(hf, p) for p in prompts]


def test_forward_without_kv_cache_raises(pair):
    ours, _ = pair
    meta = AttentionMetadata.build([0], [2], [[0]], 4)
    with pytest.raises(RuntimeError, match="no KV cache bound"):
        ours(torch.tensor([1, 2]), meta.positions(), meta)


def test_bfloat16_runs_and_mostly_agrees(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("llama")
    model = load_checkpoint(path, dtype="bfloat16").model
    assert next(model.parameters()).dtype == torch.bfloat16
    ref = load_checkpoint(path, dtype="float32").model
    prompts = random_prompts([6], seed=5)
    got, want = paged_greedy(model, prompts, max_new=8)[0], paged_greedy(ref, prompts, max_new=8)[0]
    assert got[:2] == want[:2]


# ---------------------------------------------------------------- the real default model

# Chosen for a clear top-1/top-2 margin of the first token (> 0.3 logits); "What is the capital of
# France?" is a near tie (0.08) and is avoided.
REAL_PROMPTS = (
    "Name three primary colors.",
    "What is 2 + 2?",
    "How do I boil an egg?",
    "Write a haiku about the ocean.",
)
REAL_NEW_TOKENS = 32


def _chat_ids(tokenizer, text):
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_default_model_greedy_matches_transformers(default_model, default_hf_model):
    prompts = [_chat_ids(default_model.tokenizer, text) for text in REAL_PROMPTS]
    with torch.inference_mode():
        for p in prompts:
            top = default_hf_model(torch.tensor([p])).logits[0, -1].topk(2).values
            assert float(top[0] - top[1]) > 0.2, "prompt became a near tie: pick another"
    got = paged_greedy(default_model.model, prompts, max_new=REAL_NEW_TOKENS, block_size=16)
    for text, p, ours in zip(REAL_PROMPTS, prompts, got, strict=True):
        assert ours == hf_greedy(default_hf_model, p, REAL_NEW_TOKENS), text


def test_layers_share_one_rotary_table_per_configuration(tiny_checkpoint_factory):
    from core_pytorch_backend.layers import RotaryEmbedding
    from core_pytorch_backend.loader import load_checkpoint

    model = load_checkpoint(tiny_checkpoint_factory("llama"), dtype="float32").model
    tables = {id(m) for m in model.modules() if isinstance(m, RotaryEmbedding)}
    per_layer = {id(layer.self_attn.rotary_emb) for layer in model.model.layers}
    assert len(model.model.layers) > 1 and len(tables) == 1 and per_layer == tables


# logits_scaling; soft caps; activations, norms and scales whose small differences greedy tokens may not show
LOGIT_CASES = {arch: (arch, {}) for arch in ("granite", "gemma3_text", "gemma2", "gemma", "stablelm", "starcoder2",
                                               "gpt_neox", "olmo", "phi", "opt", "gpt2", "cohere", "cohere2",
                                               "nemotron", "gptj", "granitemoe", "gpt_bigcode", "falcon",
                                               "ministral3", "apertus", "vaultgemma", "nanochat", "jais2",
                                               "persimmon", "codegen", "xglm", "biogpt")}
LOGIT_CASES["gpt-bigcode-multi-head"] = ("gpt_bigcode", dict(multi_query=False))
LOGIT_CASES["falcon-40b-new-architecture"] = ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2))
LOGIT_CASES["falcon-sequential-bias"] = ("falcon", dict(parallel_attn=False, bias=True))
LOGIT_CASES["falcon-rw-alibi"] = ("falcon", dict(alibi=True, multi_query=False, parallel_attn=False, bias=True))
LOGIT_CASES["cohere-qk-norm-scaled"] = ("cohere", dict(use_qk_norm=True, logit_scale=0.25))
LOGIT_CASES["gpt2-scaled-by-inverse-layer"] = ("gpt2", dict(scale_attn_by_inverse_layer_idx=True))
LOGIT_CASES["gpt-neox-20b-gelu-fast"] = ("gpt_neox", dict(hidden_act="gelu_fast"))
LOGIT_CASES["llama-gated-gelu-new"] = ("llama", dict(hidden_act="gelu_new"))
LOGIT_CASES["xglm-tied"] = ("xglm", dict(tie_word_embeddings=True))
LOGIT_CASES["biogpt-tied"] = ("biogpt", dict(tie_word_embeddings=True))


@pytest.mark.parametrize("case", list(LOGIT_CASES))
@torch.inference_mode()
def test_logits_match_transformers(case, tiny_checkpoint_factory):
    """Greedy parity cannot see a scale of the logits; sampling and logprobs do."""
    from transformers import AutoModelForCausalLM

    arch, overrides = LOGIT_CASES[case]
    path = tiny_checkpoint_factory(arch, **overrides)
    ours = load_checkpoint(path, dtype="float32").model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    (prompt,) = random_prompts([11], seed=5)
    allocate_kv_caches(ours, 4, 4)
    meta = AttentionMetadata.build([0], [len(prompt)], [[2, 0, 3]], 4)
    hidden = ours(torch.tensor(prompt), meta.positions(), meta)
    unbind_kv_caches(ours)
    expected = hf(torch.tensor([prompt])).logits[0]
    scale = expected.abs().max().item()  # small logits (a tiny GPT-2's) must not hide in the absolute tolerance
    torch.testing.assert_close(ours.compute_logits(hidden), expected, rtol=1e-4, atol=1e-5 * scale)


def test_odd_partial_rotary_is_refused_at_load(tiny_checkpoint_factory):
    odd = tiny_checkpoint_factory("phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.35})
    with pytest.raises(NotImplementedError, match="partial_rotary_factor 0.35 gives 5 rotated"):
        load_checkpoint(odd, dtype="float32")


def _longrope(rotated: int, **extra) -> dict:
    """Phi-3.5's rope settings for a head of ``rotated`` rotary values: short factors all apart (a wrong one
    shows), long ones that transformers only takes past the original context."""
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.37 * i for i in range(rotated // 2)],
            "long_factor": [40.0] * (rotated // 2), **extra}


# (config overrides, the context served). Phi-3.5-mini's layout: the attention factor from
# max_position_embeddings over original_max_position_embeddings; Phi-4-mini's: rotary on 0.75 of each head;
# and a config that names its factor and attention factor itself
LONGROPE = {
    "phi3.5": (dict(max_position_embeddings=256, original_max_position_embeddings=48, rope_parameters=_longrope(16)), 48),
    "phi4-mini-partial": (dict(max_position_embeddings=512, original_max_position_embeddings=40,
                               rope_parameters=_longrope(12, partial_rotary_factor=0.75)), 40),
    "named-factors": (dict(max_position_embeddings=256, original_max_position_embeddings=64,
                           rope_parameters=_longrope(16, factor=3.0, attention_factor=1.4)), 64),
}


@pytest.mark.parametrize("variant", list(LONGROPE))
def test_longrope_matches_transformers_within_its_original_context(variant, tiny_checkpoint_factory):
    """LongRoPE (layers/rotary.py) is served with its short factors and attention factor over its original
    context, where transformers keeps them: the same text there, and no position past it."""
    from transformers import AutoModelForCausalLM

    overrides, served = LONGROPE[variant]
    path = tiny_checkpoint_factory("phi3", **overrides)
    loaded = load_checkpoint(path, dtype="float32")
    assert loaded.max_model_len == served
    ours = loaded.model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "longrope"
    prompts = random_prompts([served - NEW_TOKENS, 7], seed=5)  # the first ends on the context's last position
    assert paged_greedy(ours, prompts, block_size=4, prefill_chunks=2) == [hf_greedy(hf, p) for p in prompts]


@pytest.mark.parametrize("variant", ["phi3.5", "phi4-mini-partial"])
def test_longrope_past_its_original_context_matches_transformers_for_longer_prompts(variant, tiny_checkpoint_factory):
    """Asked to serve past the original context (max_model_len), every position takes the long factors: what
    transformers does for a prompt longer than the original context, from its prefill on."""
    from transformers import AutoModelForCausalLM

    overrides, original = LONGROPE[variant]
    path = tiny_checkpoint_factory("phi3", **overrides)
    loaded = load_checkpoint(path, dtype="float32", max_model_len=overrides["max_position_embeddings"])
    assert loaded.max_model_len == overrides["max_position_embeddings"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts([original + 9, original + 30], seed=6)
    assert paged_greedy(loaded.model, prompts, block_size=4, prefill_chunks=2) == [hf_greedy(hf, p) for p in prompts]
    short = load_checkpoint(path, dtype="float32")  # the default: the original context, the short factors
    assert short.max_model_len == original and not torch.equal(short.model.model.layers[0].self_attn.rotary_emb.cos_cache,
                                                               loaded.model.model.layers[0].self_attn.rotary_emb.cos_cache[:original])


def test_longrope_takes_one_short_factor_per_rotary_frequency():
    from core_pytorch_backend.layers.rotary import longrope_frequencies

    params = {**_longrope(16), "original_max_position_embeddings": 64, "factor": 4.0}
    inv_freq, attention = longrope_frequencies(16, params)
    assert inv_freq.shape == (8,) and attention == pytest.approx((1 + math.log(4) / math.log(64)) ** 0.5)
    with pytest.raises(NotImplementedError, match="longrope needs 8 short_factor values"):
        longrope_frequencies(16, {**params, "short_factor": [1.0] * 5})


def test_gpt_neox_reads_either_head_name_and_skips_older_buffers(tiny_checkpoint_factory, tmp_path):
    """transformers saves the LM head as embed_out (Pythia's name); a file may name it lm_head, and older
    ones keep the causal mask and rotary buffers beside the weights: the same text from each."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tiny_checkpoint_factory("gpt_neox")
    older = tmp_path / "older"
    shutil.copytree(path, older)
    (weights,) = older.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["lm_head.weight"] = tensors.pop("embed_out.weight")
    tensors["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    tensors["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    tensors["gpt_neox.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(2)
    save_file(tensors, weights, metadata={"format": "pt"})
    prompts = random_prompts([9], seed=3)
    expected = paged_greedy(load_checkpoint(path, dtype="float32").model, prompts)
    assert paged_greedy(load_checkpoint(older, dtype="float32").model, prompts) == expected


@pytest.mark.parametrize("overrides, match", [(dict(do_layer_norm_before=False), "do_layer_norm_before"),
                                              (dict(word_embed_proj_dim=32), "word_embed_proj_dim")])
def test_opt_layouts_it_does_not_run_are_refused_at_load(overrides, match, tiny_checkpoint_factory):
    """opt-350m's post-norm layers and projected embeddings would give wrong text, not an error."""
    with pytest.raises(NotImplementedError, match=match):
        load_checkpoint(tiny_checkpoint_factory("opt", **overrides), dtype="float32")


@pytest.mark.parametrize("overrides, match", [
    (dict(new_decoder_architecture=True, num_kv_heads=2, parallel_attn=False), "parallel_attn"),
    (dict(num_ln_in_parallel_attn=2), "num_ln_in_parallel_attn")])
def test_falcon_layouts_it_does_not_run_are_refused_at_load(overrides, match, tiny_checkpoint_factory):
    with pytest.raises(NotImplementedError, match=match):
        load_checkpoint(tiny_checkpoint_factory("falcon", **overrides), dtype="float32")


def test_apertus_reads_each_layers_xielu_beta_and_eps(tiny_checkpoint_factory, tmp_path):
    """xIELU's beta and eps are buffers in Apertus's checkpoints (0.5 and -1e-6 as transformers builds them):
    values of the file's own, per layer, give transformers' text, not the defaults'."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "apertus"
    shutil.copytree(tiny_checkpoint_factory("apertus"), folder)
    (weights,) = folder.glob("*.safetensors")
    tensors = load_file(weights)
    for i, (beta, eps) in enumerate([(0.1, -0.4), (0.9, -2.0)]):
        tensors[f"model.layers.{i}.mlp.act_fn.beta"], tensors[f"model.layers.{i}.mlp.act_fn.eps"] = (
            torch.tensor(beta), torch.tensor(eps))
    save_file(tensors, weights, metadata={"format": "pt"})
    ours = load_checkpoint(folder, dtype="float32").model
    assert float(ours.model.layers[1].mlp.act_fn.eps) == -2.0
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert_greedy_matches((ours, hf), [12, 5], seed=6)


@pytest.mark.parametrize("arch", ["ministral3", "apertus", "vaultgemma", "nanochat", "jais2"])
def test_int8_quantization_packs_every_projection_and_keeps_the_text(arch, tiny_checkpoint_factory):
    """--quantization int8 on the newer decoders' own layers (Apertus's xIELU MLP, NanoChat's fc1 / fc2 and
    reordered q / k rows, Jais 2's biased ungated MLP): every linear layer packed, the LM head too, and the
    float model's greedy tokens."""
    path = tiny_checkpoint_factory(arch)
    packed = load_checkpoint(path, dtype="float32", quantization="int8").model
    dense = [name for name, module in packed.named_modules()
             if hasattr(module, "matmul") and isinstance(module.weight, torch.Tensor)]
    assert dense == []
    prompts = random_prompts([11, 4], seed=5)
    assert paged_greedy(packed, prompts, max_new=8) == paged_greedy(load_checkpoint(path, dtype="float32").model,
                                                                      prompts, max_new=8)


@pytest.mark.parametrize("text", ["ministral3", "mistral"])
def test_mistral3_checkpoint_serves_its_language_model(text, make_tiny_config, tmp_path):
    """Mistral 3's released class (Ministral 3's text model, or Mistral Small 3.1's Mistral one) beside a tiny
    Pixtral tower and projector, which the backend skips: transformers' text for text-only prompts."""
    import transformers

    from core_pytorch_backend.testing import reinit_, tiny_tokenizer

    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, head_dim=16, image_size=28, patch_size=14)
    config = transformers.Mistral3Config(text_config=make_tiny_config(text).to_dict(), vision_config=vision.to_dict(),
                                         image_token_index=250, spatial_merge_size=1)
    torch.manual_seed(0)
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    reinit_(model)
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path, dtype="float32").model
    assert type(ours).__name__ == "Mistral3ForConditionalGeneration"
    prompts = random_prompts([23, 6], seed=7)
    assert paged_greedy(ours, prompts, block_size=4, prefill_chunks=2) == [hf_greedy(model, p) for p in prompts]
