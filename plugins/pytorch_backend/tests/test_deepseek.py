"""DeepSeek-V2 and DeepSeek-V3 (models/deepseek_v2.py, models/deepseek_v3.py) and the grouped router they share
with GLM-4.5 and dots.llm1 (models/grouped_router.py): greedy parity with transformers' generate (one sequence,
a batch of different lengths, chunked prefill) and logits parity on tiny random checkpoints in the layouts the
real ones use (V2-Lite: q_proj and greedy routing; V2: q LoRA and group-limited routing; V3: q LoRA, noaux_tc,
YaRN; Moonlight: no q LoRA, one group), each routing rule against transformers' routers, the checkpoint layouts
(fused experts, multi-token-prediction layers, FP8 blocks) and the configs refused at load. Then GLM-4.5
(models/glm4_moe.py) and dots.llm1 (models/dots1.py), the same router under GQA attention, in their real
layouts (GLM-4.5: rotary on half of each head, q/k/v biases, one expert group, a multi-token-prediction layer in
the file; dots.llm1: per-head q/k norms, two shared experts) and variants (GLM's q/k norms and expert groups,
dots' windowed layers), and Solar Open (models/solar_open.py: the router on every layer under Llama's
attention) and Youtu-LLM (models/youtu.py: V3's attention over dense MLPs). GLM-4.7-Flash is V3's decoder with
dense layers by mlp_layer_types, MiniCPM3 MLA over dense MLPs (rotate-half rotary, Granite-style scalings), EXAONE
MoE the grouped router under EXAONE 4's attention with its own field names."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core_pytorch_backend import testing
from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.kernels import reference
from core_pytorch_backend.layers import allocate_kv_caches, unbind_kv_caches
from core_pytorch_backend.loader import load_checkpoint
from core_pytorch_backend.testing import (
    TINY_VOCAB,
    assert_greedy_matches,
    built_once,
    hf_greedy,
    ours_and_transformers,
    paged_greedy,
    random_prompts,
    reinit_,
    tiny_tokenizer,
)

COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=257,
              eos_token_id=258, pad_token_id=259, tie_word_embeddings=False,
              # 16 experts of 32, three a token, a shared MLP; the first layer dense, the second sparse
              n_routed_experts=16, num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1,
              first_k_dense_replace=1)
MLA = dict(kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


def yarn(mscale: float) -> dict:
    """DeepSeek's YaRN settings (factor 40, mscale = mscale_all_dim) over an original context of 16 positions, and
    the 40 x 16 positions of max_position_embeddings that go with them."""
    return dict(max_position_embeddings=640, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale})


# name -> (config class name, overrides)
CONFIGS = {
    # DeepSeek-V2-Lite: q_proj (no q LoRA), greedy softmax routing over every expert, YaRN with mscale 0.707
    "v2-lite": ("DeepseekV2Config", dict(**MLA, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1,
                                         routed_scaling_factor=1.0, **yarn(0.707))),
    # DeepSeek-V2 / V2.5: q LoRA, the best 2 of 4 groups (ranked by their best expert), weights x 16
    "v2": ("DeepseekV2Config", dict(**MLA, q_lora_rank=48, topk_method="group_limited_greedy", n_group=4,
                                    topk_group=2, routed_scaling_factor=16.0, **yarn(0.707))),
    # DeepSeek-V3 / R1 / Kimi K2: q LoRA, noaux_tc over the best 2 of 4 groups, renormalized, x 2.5, YaRN
    "v3": ("DeepseekV3Config", dict(**MLA, q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=True,
                                    routed_scaling_factor=2.5, **yarn(1.0))),
    # Moonlight: no q LoRA, one group, default rope
    "moonlight": ("DeepseekV3Config", dict(**MLA, q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=True,
                                           routed_scaling_factor=2.446,
                                           rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    # rotate-half rotary (rope_interleave off), without renormalization
    "v3-rotate-half": ("DeepseekV3Config", dict(**MLA, q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=False,
                                                routed_scaling_factor=2.5, rope_interleave=False)),
    # GLM-4.7-Flash: V3's decoder, its dense layers named by mlp_layer_types (the first by default), no groups
    "glm4.7-flash": ("Glm4MoeLiteConfig", dict(**MLA, q_lora_rank=48, n_group=1, topk_group=1, norm_topk_prob=True,
                                               routed_scaling_factor=1.8)),
    # ... every layer sparse, rotate-half rotary, groups, unnormalized weights, YaRN
    "glm4.7-flash-all-sparse-rotate-half": ("Glm4MoeLiteConfig", dict(
        **MLA, q_lora_rank=48, n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=2.5,
        rope_interleave=False, mlp_layer_types=["sparse", "sparse"], **yarn(1.0))),
    # MiniCPM3: MLA with rotate-half rotary, dense MLPs, embeddings x 12, residual branches x 1.4 / sqrt(2), the
    # final hidden states / (64 / 16)
    "minicpm3": ("MiniCPM3Config", dict(**MLA, q_lora_rank=48, scale_emb=12, scale_depth=1.4, dim_model_base=16)),
    # ... no q LoRA, q_a / kv_a / o and MLP biases, tied embeddings, YaRN
    "minicpm3-no-q-lora-biases-tied-yarn": ("MiniCPM3Config", dict(
        **MLA, q_lora_rank=None, attention_bias=True, mlp_bias=True, tie_word_embeddings=True, scale_emb=2.5,
        scale_depth=1.0, dim_model_base=32, **yarn(0.707))),
    # Youtu-LLM: V3's attention (q LoRA, pair rotary) over dense MLPs on every layer, tied embeddings. No pad
    # token: transformers' Youtu zeroes the pad token's embedding row as it loads, whatever the file holds
    "youtu": ("YoutuConfig", dict(**MLA, q_lora_rank=48, tie_word_embeddings=True, pad_token_id=None)),
    # ... no q LoRA, rotate-half rotary, biases, YaRN's mscale in the softmax scale, untied
    "youtu-no-q-lora-rotate-half-bias-yarn": ("YoutuConfig", dict(
        **MLA, q_lora_rank=None, rope_interleave=False, attention_bias=True, tie_word_embeddings=False,
        pad_token_id=None, **yarn(0.707))),
    # biases on q_a_proj, kv_a_proj_with_mqa (its rotary rows reordered with the weight's) and o_proj; an
    # rms_norm_eps the latent norms do not take (theirs is 1e-6) large enough to show
    "v2-attention-bias": ("DeepseekV2Config", dict(**MLA, q_lora_rank=48, topk_method="group_limited_greedy",
                                                   n_group=4, topk_group=2, attention_bias=True, rms_norm_eps=0.01)),
}

# GLM-4.5 and dots.llm1: the same router under GQA attention
GQA = dict(COMMON, num_key_value_heads=2, head_dim=16)
ROUTED = dict(norm_topk_prob=True, routed_scaling_factor=2.5)

# name -> (config class name, overrides)
GLM_CONFIGS = {
    # GLM-4.5 / 4.5-Air: q/k/v biases, no q/k norms, rotary on half of each head, one group
    "glm4.5": ("Glm4MoeConfig", dict(**ROUTED, attention_bias=True, use_qk_norm=False, n_group=1, topk_group=1,
                                     num_nextn_predict_layers=1)),
    # per-head q/k norms, no biases, the best 2 of 4 groups, rotary on three quarters of each head
    "glm4.5-qk-norm-groups": ("Glm4MoeConfig", dict(**ROUTED, attention_bias=False, use_qk_norm=True, n_group=4,
                                                    topk_group=2, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 10000.0,
                                                                                   "partial_rotary_factor": 0.75})),
    # dots.llm1: Qwen3's attention, two shared experts, one group
    "dots1": ("Dots1Config", dict(**ROUTED, n_shared_experts=2, n_group=1, topk_group=1, sliding_window=None)),
    # a window of 5 on the layers from max_window_layers on, q/k/v/o biases, unnormalized weights
    "dots1-window-bias": ("Dots1Config", dict(norm_topk_prob=False, routed_scaling_factor=1.0, n_shared_experts=1,
                                              n_group=4, topk_group=2, sliding_window=5, max_window_layers=1,
                                              attention_bias=True)),
    # Solar Open: every layer sparse (whatever first_k_dense_replace says), Llama's attention with q/k/v biases
    "solar-open": ("SolarOpenConfig", dict(**ROUTED, attention_bias=True, n_group=1, topk_group=1)),
    # ... no biases, two shared experts, the best 2 of 4 groups, unnormalized weights
    "solar-open-groups-no-bias": ("SolarOpenConfig", dict(norm_topk_prob=False, routed_scaling_factor=1.5,
                                                          attention_bias=False, n_shared_experts=2, n_group=4,
                                                          topk_group=2)),
}

# EXAONE MoE: the same router, its own field names (num_experts, num_shared_experts), EXAONE 4.0's attention in
# pre-norm layers: a windowed layer with rotary, a global one without
EXAONE = {key: value for key, value in GQA.items()
          if key not in ("n_routed_experts", "n_shared_experts", "first_k_dense_replace")}
EXAONE_CONFIGS = {
    "exaone-moe": ("ExaoneMoeConfig", dict(**ROUTED, num_experts=16, num_shared_experts=1, n_group=1, topk_group=1,
                                           sliding_window=6, sliding_window_pattern=2,
                                           mlp_layer_types=["dense", "sparse"])),
    # the global layer first, every layer sparse, two shared experts, the best 2 of 4 groups
    "exaone-moe-global-first-groups": ("ExaoneMoeConfig", dict(
        **ROUTED, num_experts=16, num_shared_experts=2, n_group=4, topk_group=2, sliding_window=5,
        layer_types=["full_attention", "sliding_attention"], mlp_layer_types=["sparse", "sparse"])),
}

PARITY = ("v2-lite", "v3", "glm4.7-flash", "minicpm3", "youtu", "glm4.5", "dots1", "exaone-moe", "solar-open")
VARIANTS = [name for name in (*CONFIGS, *GLM_CONFIGS, *EXAONE_CONFIGS) if name not in PARITY]


def make_config(cls_name: str, overrides: dict, common: dict = COMMON):
    import transformers

    return getattr(transformers, cls_name)(**{**common, **overrides})


def build_checkpoint(config, folder: Path) -> Path:
    """A tiny random checkpoint with random ``e_score_correction_bias`` (transformers starts them at 0) of a
    size that changes which experts are chosen."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reinit_(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.3)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@torch.inference_mode()
def our_logits(model, prompt: list[int]) -> torch.Tensor:
    """Every position's logits of ``prompt``, prefilled in one step over blocks in reverse order."""
    blocks = -(-len(prompt) // 4)
    allocate_kv_caches(model, blocks + 2, 4)
    meta = AttentionMetadata.build([0], [len(prompt)], [list(range(blocks + 1, 0, -1))[:blocks]], 4)
    hidden = model(torch.tensor(prompt), meta.positions(), meta)
    unbind_kv_caches(model)
    return model.compute_logits(hidden)


@torch.inference_mode()
def assert_logits_match(ours, hf, seed: int = 5) -> None:
    (prompt,) = random_prompts([21], seed=seed)
    torch.testing.assert_close(our_logits(ours, prompt), hf(torch.tensor([prompt])).logits[0], rtol=1e-4, atol=1e-4)


def assert_greedy_match(ours, hf, lengths=(23, 6), chunks: int = 2, seed: int = 7) -> None:
    prompts = random_prompts(list(lengths), seed=seed)
    assert paged_greedy(ours, prompts, block_size=4, prefill_chunks=chunks) == [hf_greedy(hf, p) for p in prompts]


def _with_mtp_layer(folder: Path, layers: int) -> None:
    """GLM-4.5's checkpoints hold the multi-token-prediction layer after the others: a copy of the last one
    (and its own projections) as ``model.layers.{layers}``, which the model must skip."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    last = f"model.layers.{layers - 1}."
    extra = {k.replace(last, f"model.layers.{layers}."): v.clone() for k, v in tensors.items() if k.startswith(last)}
    extra[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **extra}, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    def build(name: str, folder: Path) -> Path:
        if name in EXAONE_CONFIGS:
            config = make_config(*EXAONE_CONFIGS[name], EXAONE)
        else:
            config = make_config(*CONFIGS[name]) if name in CONFIGS else make_config(*GLM_CONFIGS[name], GQA)
        path = build_checkpoint(config, folder)
        if name in GLM_CONFIGS and GLM_CONFIGS[name][1].get("num_nextn_predict_layers"):
            _with_mtp_layer(path, GQA["num_hidden_layers"])
        return path

    return built_once(tmp_path_factory, build)


@pytest.fixture(scope="module", params=PARITY)
def pair(request, checkpoint):
    return ours_and_transformers(checkpoint(request.param))


def test_single_sequence_matches_transformers(pair):
    assert_greedy_matches(pair, [9], block_size=16)


def test_batched_varlen_prefill_then_decode(pair):
    assert_greedy_matches(pair, [3, 13, 1, 8], seed=2)


def test_chunked_prefill_with_cached_prefix(pair):
    assert_greedy_match(*pair, lengths=(14, 7), chunks=3, seed=3)


def test_logits_match_transformers(pair):
    assert_logits_match(*pair)


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_variants_match_transformers(variant, checkpoint):
    ours, hf = ours_and_transformers(checkpoint(variant))
    assert_logits_match(ours, hf)
    assert_greedy_match(ours, hf)


def test_kv_cache_holds_expanded_heads(checkpoint):
    """Every head's K (qk_nope + qk_rope wide) and V (v_head_dim, padded to K's width) in the cache."""
    from core_pytorch_backend.layers.attention import attention_layers, kv_cache_shape

    model = load_checkpoint(checkpoint("v3"), dtype="float32").model
    attn = attention_layers(model)[0]
    assert (attn.num_kv_heads, attn.head_dim, attn.v_head_dim) == (4, 24, 12)
    assert kv_cache_shape(model, 8, 4) == (8, 4, 4, 24)


def test_router_stays_float32_in_a_bfloat16_model(checkpoint):
    """As transformers keeps ``gate.weight`` and ``e_score_correction_bias`` (``_keep_in_fp32_modules_strict``)."""
    path = checkpoint("v3")
    layer = load_checkpoint(path, dtype="bfloat16").model.model.layers[1]
    tensors = load_file(str(path / "model.safetensors"))
    for name in ("weight", "e_score_correction_bias"):
        param = getattr(layer.mlp.gate, name)
        assert param.dtype == torch.float32 and torch.equal(param, tensors[f"model.layers.1.mlp.gate.{name}"])
    assert layer.input_layernorm.weight.dtype == torch.bfloat16


# ---------------------------------------------------------------- each routing rule against transformers' router


def _sorted(weights: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = chosen.sort(dim=-1).indices
    return weights.gather(-1, order), chosen.gather(-1, order)


def routing_rule(config):
    from core_pytorch_backend.models.deepseek_v2 import v2_routing
    from core_pytorch_backend.models.grouped_router import noaux_tc_routing

    return v2_routing(config) if config.model_type == "deepseek_v2" else noaux_tc_routing(config)


@torch.inference_mode()
def assert_router_matches(config, router) -> None:
    """Our block's routing of 256 random tokens against transformers' ``router`` (its weights random, its
    correction bias too); and the group limit and the correction bias each change some token's experts."""
    from core_pytorch_backend.models.grouped_router import GroupedMoeBlock

    reinit_(router, std=0.3)
    block = GroupedMoeBlock(config, reference, routing_rule(config))
    block.gate.weight.copy_(router.weight)
    bias = None
    if block.rule.noaux_tc:
        bias = torch.randn(config.n_routed_experts, generator=torch.Generator().manual_seed(2)) * 0.3
        router.e_score_correction_bias.copy_(bias)
        block.gate.e_score_correction_bias.copy_(bias)
    hidden = torch.randn(256, config.hidden_size, generator=torch.Generator().manual_seed(3))
    weights, chosen = _sorted(*block.routing(hidden))
    _, their_weights, their_chosen = router(hidden)
    their_weights, their_chosen = _sorted(their_weights, their_chosen)
    assert torch.equal(chosen, their_chosen)
    torch.testing.assert_close(weights, their_weights)
    logits = hidden @ router.weight.T
    if block.rule.groups > 1:
        ungrouped = dataclasses.replace(block.rule, groups=1, kept_groups=1)
        assert not torch.equal(_sorted(*ungrouped.route(logits, bias))[1], chosen)
    if bias is not None:
        assert not torch.equal(_sorted(*block.rule.route(logits, None))[1], chosen)


@pytest.mark.parametrize("name, overrides", [
    ("v2-lite", {}),
    ("v2", {}),
    ("v2", dict(n_group=8, topk_group=3, num_experts_per_tok=6)),  # DeepSeek-V2: 6 experts from 3 of 8 groups
    ("v3", {}),
    ("v3", dict(norm_topk_prob=False)),
    ("v3", dict(n_group=8, topk_group=4, num_experts_per_tok=4)),  # DeepSeek-V3's 8 groups, 4 kept
], ids=["v2-greedy", "v2-group-limited", "v2-8-groups", "v3-noaux-tc", "v3-unnormalized", "v3-8-groups"])
def test_router_matches_transformers(name, overrides):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = make_config(CONFIGS[name][0], {**CONFIGS[name][1], **overrides})
    router = DeepseekV2TopkRouter if config.model_type == "deepseek_v2" else DeepseekV3TopkRouter
    assert_router_matches(config, router(config))


# ---------------------------------------------------------------- checkpoint layouts


def _rewrite(source: Path, folder: Path, tensors: dict[str, torch.Tensor], **config_changes) -> Path:
    """A copy of ``source`` holding ``tensors`` (and its config.json updated with ``config_changes``)."""
    import json
    import shutil

    shutil.copytree(source, folder)
    (folder / "model.safetensors").unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return folder


def _fused_experts(tensors: dict[str, torch.Tensor], layers: range, experts: int) -> dict[str, torch.Tensor]:
    """transformers' fused layout: ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj``."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for i in layers:
        p = f"model.layers.{i}.mlp.experts"
        out[f"{p}.gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}.{e}.gate_proj.weight"],
                                                           tensors[f"{p}.{e}.up_proj.weight"]]) for e in range(experts)])
        out[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(experts)])
    return out


def test_fused_experts_and_multi_token_prediction_layer_load(checkpoint, tmp_path):
    """transformers' fused expert tensors, and DeepSeek-V3's extra layer (model.layers.{num_hidden_layers}:
    the multi-token-prediction module) skipped: the same logits as the per-expert checkpoint's."""
    source = checkpoint("v3")
    ours, hf = ours_and_transformers(source)
    tensors = load_file(str(source / "model.safetensors"))
    fused = _fused_experts(tensors, range(1, 2), 16)
    mtp = {k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if "model.layers.1." in k}
    mtp["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    path = _rewrite(source, tmp_path / "fused", {**fused, **mtp}, num_nextn_predict_layers=1)
    (prompt,) = random_prompts([21], seed=5)
    torch.testing.assert_close(our_logits(load_checkpoint(path, dtype="float32").model, prompt),
                               our_logits(ours, prompt), rtol=0, atol=0)


def test_fp8_block_checkpoint_is_dequantized_at_load(checkpoint, tmp_path):
    """DeepSeek-V3's released layout (float8_e4m3fn weights, ``weight_scale_inv`` per block): served as
    transformers serves the weights the codes stand for. Blocks of 16 x 32 here, so that weights of 24, 48 and
    96 rows and 64 or 24 inputs end in partial blocks and a transposed block shape would show."""
    source = checkpoint("v3")
    tensors = load_file(str(source / "model.safetensors"))
    quantized, dequantized = dict(tensors), dict(tensors)
    for name, tensor in tensors.items():
        if name.endswith(("proj.weight", "proj_with_mqa.weight")):
            quantized[name], quantized[name + "_scale_inv"], dequantized[name] = testing.fp8_blocks(tensor, (16, 32))
    fp8 = _rewrite(source, tmp_path / "fp8", dict(reversed(quantized.items())), quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 32]})
    ours = load_checkpoint(fp8, dtype="float32").model
    assert_logits_match(ours, ours_and_transformers(_rewrite(source, tmp_path / "plain", dequantized))[1])


def test_fp8_weights_pair_with_their_scales_in_either_order():
    from core_pytorch_backend.quant.fp8_blocks import fp8_blocks_dequantized

    codes, scale, exact = testing.fp8_blocks(torch.randn(40, 70), (16, 32))
    tensors = [("a.weight", codes), ("a.weight_scale_inv", scale), ("b.weight", torch.ones(2))]
    for order in (tensors, tensors[::-1]):
        out = dict(fp8_blocks_dequantized(order, (16, 32)))
        assert out.keys() == {"a.weight", "b.weight"} and torch.equal(out["a.weight"], exact)
    with pytest.raises(ValueError, match="without their pair"):
        list(fp8_blocks_dequantized(tensors[:1], (16, 32)))


# ---------------------------------------------------------------- refused at load


@pytest.mark.parametrize("name, overrides, match", [
    ("v2", dict(topk_method="noaux_tc"), "topk_method 'noaux_tc'"),
    ("v2", dict(norm_topk_prob=True), "norm_topk_prob"),
    ("v2", dict(mlp_bias=True), "mlp_bias"),
    ("v2", dict(moe_layer_freq=2), "moe_layer_freq 2"),
    ("v3", dict(topk_method="greedy"), "topk_method 'greedy'"),
    ("v3", dict(quantization_config={"quant_method": "compressed-tensors"}), "quantization_config"),
    ("v3", dict(quantization_config={"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}),
     "quantization_config"),
    ("v3", dict(topk_group=1, num_experts_per_tok=5), "num_experts_per_tok 5"),
    # groups of one expert: noaux_tc ranks a group by its best two (a run-time topk error in transformers too)
    ("v3", dict(n_routed_experts=4, n_group=4, topk_group=2, num_experts_per_tok=2), "groups of one expert"),
])
def test_unsupported_configs_are_refused_at_load(name, overrides, match, tmp_path):
    config = make_config(CONFIGS[name][0], {**CONFIGS[name][1], **overrides})
    config.save_pretrained(tmp_path)
    with pytest.raises((NotImplementedError, ValueError), match=match):
        load_checkpoint(tmp_path, dtype="float32")


# GLM-4.5 and dots.llm1: DeepSeek-V3's router under GQA attention (the shared parity tests above)


@pytest.mark.parametrize("name", ["glm4.5-qk-norm-groups", "dots1-window-bias"])
def test_glm_dots_router_matches_transformers(name):
    from transformers.models.dots1.modeling_dots1 import Dots1TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = make_config(*GLM_CONFIGS[name], GQA)
    assert_router_matches(config, (Glm4MoeTopkRouter if config.model_type == "glm4_moe" else Dots1TopkRouter)(config))


def test_glm_quantized_checkpoints_are_refused_at_load(tmp_path):
    from core_pytorch_backend.loader import load_checkpoint

    config = make_config(*GLM_CONFIGS["glm4.5"], GQA)
    config.quantization_config = {"quant_method": "compressed-tensors"}
    config.save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="quantization_config .quant_method 'compressed-tensors'"):
        load_checkpoint(tmp_path, dtype="float32")
