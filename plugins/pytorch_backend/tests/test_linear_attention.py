"""Linear-attention hybrids: MiniMax-Text-01 / M1 (models/minimax.py, its lightning attention in
models/lightning_attention.py) and Kimi Linear (models/kimi_linear.py: Kimi Delta Attention and NoPE MLA).
For each family: greedy parity with transformers' generate (one sequence longer than a KDA chunk; a batch of
different lengths; prefill in chunks, and in chunks of 1-4 tokens, shorter than KDA's convolution) and
logits parity on tiny random checkpoints in the released layouts, every recurrent slot NaN before its
sequence starts (core_pytorch_backend.testing); the config variants the released checkpoints use; bfloat16;
each prompt form against its token-by-token recurrence; the configs refused at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core_pytorch_backend.layers.attention import attention_layers
from core_pytorch_backend.layers.recurrent import recurrent_layers
from core_pytorch_backend.loader import load_checkpoint
from core_pytorch_backend.testing import (
    TINY_VOCAB,
    assert_logits_close,
    built_once,
    hf_greedy,
    ours_and_transformers,
    paged_greedy,
    prompt_logits,
    random_prompts,
    reinit_,
    tiny_tokenizer,
)

COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=257, eos_token_id=258,
              pad_token_id=259, tie_word_embeddings=False)

# family -> (config class, overrides)
FAMILIES = {
    # MiniMax-Text-01's layout in 4 layers: lightning, lightning, softmax (rotary), lightning; blocks of 5
    # tokens (prompts cross several); residual factors apart from 1 and from each other; 4 experts of 32, two
    # a token; an rms_norm_eps that the lightning output norm (1e-6) does not take, large enough to show
    "minimax": ("MiniMaxConfig", dict(
        num_hidden_layers=4, rms_norm_eps=0.01, head_dim=16, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, block_size=5,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        full_attn_alpha_factor=1.7, full_attn_beta_factor=0.9, linear_attn_alpha_factor=1.3,
        linear_attn_beta_factor=1.1, mlp_alpha_factor=1.5, mlp_beta_factor=0.8)),
    # Kimi-Linear-48B-A3B's layout in 4 layers: KDA, KDA, MLA (no q LoRA, no rotary), KDA; the first MLP
    # dense, then 8 experts of 32, two a token, and a shared one; an rms_norm_eps the latent norms (1e-6) do
    # not take
    "kimi_linear": ("KimiLinearConfig", dict(
        num_hidden_layers=4, num_key_value_heads=4, rms_norm_eps=0.01, intermediate_size=96,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], kv_lora_rank=24, q_lora_rank=None,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, linear_num_heads=4, linear_head_dim=16,
        linear_conv_kernel_dim=4, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.446)),
}

# name -> (family, overrides)
VARIANTS = {
    # the released configs' factors (3.5566 and 1), transformers' default layer pattern (softmax first), one
    # block of 256 (every prompt within its first block), tied embeddings
    "minimax-released-factors-softmax-first": ("minimax", dict(
        layer_types=None, full_attn_alpha_factor=3.5565588200778455,
        linear_attn_alpha_factor=3.5565588200778455, mlp_alpha_factor=3.5565588200778455,
        full_attn_beta_factor=1.0, linear_attn_beta_factor=1.0, mlp_beta_factor=1.0, block_size=256,
        tie_word_embeddings=True)),
    # 8 heads of 8 (head_dim from hidden_size), one KV head, blocks of 3
    "minimax-eight-heads-one-kv-head": ("minimax", dict(num_attention_heads=8, head_dim=None,
                                                        num_key_value_heads=1, block_size=3)),
    # the released config's form: linear_attn_config (1-indexed full_attn_layers / kda_layers, KDA's heads
    # and kernel) and first_k_dense_replace instead of layer_types / mlp_layer_types; 2 KDA heads of 32, a
    # kernel of 3; tie_word_embeddings, which transformers' Kimi Linear ignores (its LM head is never tied)
    "kimi-released-config-form": ("kimi_linear", dict(
        layer_types=None, mlp_layer_types=None, first_k_dense_replace=2, tie_word_embeddings=True,
        linear_attn_config={"full_attn_layers": [2, 4], "kda_layers": [1, 3], "num_heads": 2, "head_dim": 32,
                            "short_conv_kernel_size": 3})),
    # q LoRA, biases on q_a_proj / kv_a_proj_with_mqa / o_proj, the best 2 of 4 expert groups, weights not
    # renormalized, two shared experts
    "kimi-q-lora-bias-groups": ("kimi_linear", dict(q_lora_rank=48, attention_bias=True, n_group=4,
                                                    topk_group=2, norm_topk_prob=False, n_shared_experts=2)),
}


def make_config(family: str, **overrides):
    import transformers

    cls_name, own = FAMILIES[family]
    return getattr(transformers, cls_name)(**{**COMMON, **own, **overrides})


def build_checkpoint(config, folder: Path) -> Path:
    """A tiny random checkpoint; KDA's decays slow and different channel by channel (``A_log``,
    ``dt_bias``), so that a state carried over a chunk boundary matters; random expert correction biases."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reinit_(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("A_log"):
                tensor.copy_(torch.empty(tensor.shape).uniform_(0.05, 1.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 1.5 - 2.0)
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.3)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    def build(name: str, folder: Path) -> Path:
        family, overrides = VARIANTS.get(name, (name, {}))
        return build_checkpoint(make_config(family, **overrides), folder)

    return built_once(tmp_path_factory, build)


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, checkpoint):
    return ours_and_transformers(checkpoint(request.param))


def assert_greedy_match(ours, hf, lengths, chunks: int = 1, seed: int = 7) -> None:
    prompts = random_prompts(list(lengths), seed=seed)
    expected = [hf_greedy(hf, prompt) for prompt in prompts]
    assert paged_greedy(ours, prompts, block_size=4, prefill_chunks=chunks) == expected


@torch.inference_mode()
def assert_logits_match(ours, hf, length: int = 27, seed: int = 5) -> None:
    (prompt,) = random_prompts([length], seed=seed)
    assert_logits_close(prompt_logits(ours, prompt), hf(torch.tensor([prompt])).logits[0])


def test_single_sequence_matches_transformers(pair):
    """A prompt longer than two of KDA's chunks (and than many of lightning attention's blocks)."""
    assert_greedy_match(*pair, lengths=[70], seed=1)


def test_batched_varlen_prefill_then_decode(pair):
    assert_greedy_match(*pair, lengths=[3, 13, 1, 8], seed=2)


def test_chunked_prefill_continues_the_state(pair):
    assert_greedy_match(*pair, lengths=[14, 7, 9], chunks=3, seed=3)


def test_prefill_in_chunks_of_one_to_four_tokens(pair):
    assert_greedy_match(*pair, lengths=[23, 9, 7], chunks=7, seed=4)


def test_logits_match_transformers(pair):
    assert_logits_match(*pair)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_match_transformers(variant, checkpoint):
    ours, hf = ours_and_transformers(checkpoint(variant))
    assert_logits_match(ours, hf)
    assert_greedy_match(ours, hf, lengths=[23, 6], chunks=2)


def test_only_softmax_layers_hold_a_kv_cache(pair):
    ours, _ = pair
    kinds = ours.config.layer_types
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    assert [layer.layer_index for layer in attention_layers(ours)] == full
    assert len(recurrent_layers(ours)) == kinds.count("linear_attention")


# ---------------------------------------------------------------- MiniMax


def partial_rotary_transformers(hf, rotary_dim: int, monkeypatch) -> None:
    """transformers' MiniMax turning only each head's first ``rotary_dim`` values, as MiniMax trained it
    (transformers 5 turns the whole head whatever the config says): frequencies of that width, the rest of the
    head passed through."""
    from transformers.models.minimax import modeling_minimax

    rotary = hf.model.rotary_emb
    base = rotary.config.rope_parameters["rope_theta"]
    rotary.inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    whole = modeling_minimax.apply_rotary_pos_emb

    def partial(q, k, cos, sin, unsqueeze_dim=1):
        width = cos.shape[-1]
        q_rot, k_rot = whole(q[..., :width], k[..., :width], cos, sin, unsqueeze_dim)
        return torch.cat((q_rot, q[..., width:]), dim=-1), torch.cat((k_rot, k[..., width:]), dim=-1)

    monkeypatch.setattr(modeling_minimax, "apply_rotary_pos_emb", partial)


@pytest.mark.parametrize("field", [dict(rotary_dim=8), dict(partial_rotary_factor=0.5)],
                         ids=["rotary_dim", "partial_rotary_factor"])
def test_minimax_rotary_on_half_of_each_head(field, tmp_path, monkeypatch):
    """The released configs' ``rotary_dim`` 64 of 128 (or the same as a partial factor) against transformers
    with partial rotary put in."""
    ours, hf = ours_and_transformers(build_checkpoint(make_config("minimax", **field), tmp_path))
    assert ours.model.layers[2].self_attn.rotary_emb.rotary_dim == 8
    partial_rotary_transformers(hf, 8, monkeypatch)
    assert_logits_match(ours, hf)
    assert_greedy_match(ours, hf, lengths=[23, 6], chunks=2)


def test_lightning_prompt_form_matches_the_recurrence():
    """The block form of a prompt (whole blocks and a shorter last one, from a state carried in) against one
    token at a time: every output and the state after."""
    from core_pytorch_backend.models.lightning_attention import lightning_prompt, lightning_step, slope_rates

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(23, 4, 8, generator=gen) for _ in range(3))
    state = torch.randn(4, 8, 8, generator=gen)
    rates = slope_rates(4, 1, 3) * 3  # faster decays than a real layer's, so that a wrong one shows
    out, final = lightning_prompt(q, k, v, rates, state, block=5)
    expected, running = [], state[None]
    for t in range(23):
        step, running = lightning_step(q[t, None], k[t, None], v[t, None], rates, running)
        expected.append(step[0])
    torch.testing.assert_close(out, torch.stack(expected), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, running[0], rtol=1e-5, atol=1e-5)


def test_minimax_slopes_are_transformers(checkpoint):
    """Each lightning layer's decay rates, float32 in a bfloat16 model too, as transformers' ``slope_rate``
    buffers (which the loader does not read)."""
    from safetensors.torch import load_file

    from core_pytorch_backend.models.lightning_attention import LightningAttention

    tensors = load_file(str(checkpoint("minimax") / "model.safetensors"))
    ours = load_checkpoint(checkpoint("minimax"), dtype="bfloat16").model
    lightning = [(i, layer.self_attn) for i, layer in enumerate(ours.model.layers)
                 if isinstance(layer.self_attn, LightningAttention)]
    assert len(lightning) == 3
    for i, attn in lightning:
        expected = tensors[f"model.layers.{i}.self_attn.slope_rate"].view(-1)
        torch.testing.assert_close(attn.rates, expected, rtol=0, atol=0)


# ---------------------------------------------------------------- Kimi Linear


def kda_inputs(length: int, heads: int = 3, dim: int = 8, seed: int = 0):
    """Random float32 (q, k, v, g, beta, state) of KDA's shapes: q and k L2-normalized (q not yet scaled),
    slow decays, each channel its own."""
    from core_pytorch_backend.models.kimi_linear import l2norm

    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(length, heads, dim, generator=gen) for _ in range(3))
    g = -torch.rand(length, heads, dim, generator=gen) * 0.3
    beta = torch.rand(length, heads, generator=gen)
    return l2norm(q), l2norm(k), v, g, beta, torch.randn(heads, dim, dim, generator=gen)


def test_kda_prompt_form_matches_the_recurrence():
    """The chunk form (chunks of 5 and a shorter last one, from a state carried in) against one token at a
    time, and one token at a time against transformers' recurrent KDA (which scales q itself)."""
    from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

    from core_pytorch_backend.models.kimi_linear import kda_prompt, kda_step

    q, k, v, g, beta, state = kda_inputs(23)
    scaled = q * q.shape[-1] ** -0.5
    out, final = kda_prompt(scaled, k, v, g, beta, state, chunk=5)
    expected, running = [], state[None]
    for t in range(23):
        step, running = kda_step(scaled[t, None], k[t, None], v[t, None], g[t, None], beta[t, None], running)
        expected.append(step[0])
    torch.testing.assert_close(out, torch.stack(expected), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, running[0], rtol=1e-5, atol=1e-5)
    theirs, their_final = recurrent_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None],
                                                         state[None], output_final_state=True)
    torch.testing.assert_close(torch.stack(expected), theirs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(running, their_final, rtol=1e-5, atol=1e-5)


def test_kimi_dt_bias_stays_float32(checkpoint):
    """As transformers keeps it; the model's other parameters take its dtype."""
    from core_pytorch_backend.models.kimi_linear import KimiDeltaAttention

    model = load_checkpoint(checkpoint("kimi_linear"), dtype="bfloat16").model
    kda = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    assert kda.dt_bias.dtype == torch.float32 and kda.A_log.dtype == torch.bfloat16


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bfloat16_prompt_and_decode_run_close_to_float32(family, checkpoint):
    """bfloat16 weights and activations (float32 recurrent states): a prompt's logits within bfloat16's
    reach of float32's, and prefill in chunks then decode steps run."""
    model = load_checkpoint(checkpoint(family), dtype="bfloat16").model
    ref = load_checkpoint(checkpoint(family), dtype="float32").model
    (prompt,) = random_prompts([27], seed=5)
    got, want = prompt_logits(model, prompt), prompt_logits(ref, prompt)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    outs = paged_greedy(model, random_prompts([9, 4], seed=5), max_new=4, prefill_chunks=2)
    assert [len(out) for out in outs] == [4, 4]


REFUSED = {
    "minimax-prenorm": ("minimax", dict(postnorm=False), NotImplementedError, "postnorm"),
    "minimax-shared-expert": ("minimax", dict(shared_intermediate_size=32), NotImplementedError,
                              "shared_intermediate_size"),
    "minimax-attn-type-list-disagrees": ("minimax", dict(attn_type_list=[0, 1, 0, 0]), ValueError,
                                         "attn_type_list"),
    "minimax-unknown-layer-type": ("minimax", dict(layer_types=["linear_attention", "sliding_attention",
                                                                "full_attention", "linear_attention"]),
                                   ValueError, "layer_types"),
    "minimax-sliding-window": ("minimax", dict(sliding_window=5), NotImplementedError, "sliding_window"),
    "minimax-odd-rotary-dim": ("minimax", dict(rotary_dim=7), NotImplementedError, "rotary_dim"),
    "kimi-grouped-kv-heads": ("kimi_linear", dict(num_key_value_heads=2), NotImplementedError,
                              "num_key_value_heads"),
    "kimi-rotary-mla": ("kimi_linear", dict(mla_use_nope=False), NotImplementedError, "mla_use_nope"),
    "kimi-softmax-router": ("kimi_linear", dict(moe_router_activation_func="softmax"), NotImplementedError,
                            "moe_router_activation_func"),
    "kimi-moe-every-other-layer": ("kimi_linear", dict(moe_layer_freq=2), NotImplementedError,
                                   "moe_layer_freq"),
    "kimi-output-gate": ("kimi_linear", dict(mla_use_output_gate=True), NotImplementedError,
                         "mla_use_output_gate"),
    "kimi-gate-lower-bound": ("kimi_linear", dict(linear_attn_config={"gate_lower_bound": -5.0}),
                              NotImplementedError, "gate_lower_bound"),
    "kimi-unknown-layer-type": ("kimi_linear", dict(layer_types=["linear_attention", "sliding_attention",
                                                                 "full_attention", "linear_attention"]),
                                ValueError, "layer_types"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_configs_are_refused_at_load(name):
    from core_pytorch_backend.kernels import reference
    from core_pytorch_backend.loader import build_model
    from core_pytorch_backend.models import BUILTIN_ARCHITECTURES

    family, overrides, error, field = REFUSED[name]
    config = make_config(family, **overrides)
    config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    with pytest.raises(error, match=field):
        build_model(config, BUILTIN_ARCHITECTURES, reference, "cpu", torch.float32)
