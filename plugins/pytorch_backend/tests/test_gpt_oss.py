"""gpt-oss on the pytorch backend: greedy and logits parity with transformers (float32, CPU) on tiny checkpoints
in the two layouts its checkpoints come in: float experts fused and interleaved as transformers saves them, and
OpenAI's MXFP4 experts (quantized here from the float ones), against transformers' own dequantizing load.

The tiny model alternates a window of 8 and full attention (prompts up to 26 tokens), has gpt-oss's YaRN rope
settings, sinks large enough to matter, and a SwiGLU limit of 1 so that the clamps bite at these weights' scale
(the real models' limit of 7 does at theirs)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.response import collect
from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.backend import PytorchBackend
from core_pytorch_backend.kernels import select_ops
from core_pytorch_backend.layers import allocate_kv_caches, unbind_kv_caches
from core_pytorch_backend.loader import load_checkpoint
from core_pytorch_backend.models.gpt_oss import ClampedSwiGLU, GptOssForCausalLM, GptOssRMSNorm, llama_names
from core_pytorch_backend.quant.mxfp4 import FP4_VALUES, dequantize_mxfp4
from core_pytorch_backend.testing import (
    TINY_VOCAB,
    hf_greedy,
    paged_greedy,
    random_prompts,
    reinit_,
    tiny_tokenizer,
)

NEW_TOKENS = 16


def tiny_config(**overrides):
    from transformers import GptOssConfig

    settings = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    max_position_embeddings=131072, swiglu_limit=1.0, bos_token_id=257, eos_token_id=258,
                    pad_token_id=259)
    return GptOssConfig(**{**settings, **overrides})  # layer_types: sliding, full; rope: gpt-oss's YaRN


def build_checkpoint(folder: Path, mxfp4: bool = False, seed: int = 0, **overrides) -> Path:
    """A tiny random gpt-oss checkpoint as transformers saves it, or with its experts in MXFP4."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(**overrides), dtype=torch.float32)
    reinit_(model, seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.mul_(10)  # sinks of a few units, as trained ones are
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    if mxfp4:
        _to_mxfp4(folder)
    return folder


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (blocks [..., K / 32, 16], scales [..., K / 32]) of ``weight`` [..., K]: each group of 32 scaled by
    the power of two that brings its largest value within 6, every value rounded to the nearest e2m1 value."""
    groups = weight.float().unflatten(-1, (-1, 32))
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100) / 6)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - torch.tensor(FP4_VALUES)).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def _to_mxfp4(folder: Path) -> None:
    """Rewrite the folder as OpenAI's checkpoints are: the experts' MXFP4 blocks and scales of the [out, in]
    weights, and their config.json's fields (``quantization_config`` mxfp4, ``rope_scaling``, ...)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")  # OpenAI's config.json: older names, no swiglu_alpha (1.702)
    config.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope, experts_per_token=config["num_experts_per_tok"],
                  initial_context_length=rope["original_max_position_embeddings"])
    del config["swiglu_alpha"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))


def _hf(folder: Path, mxfp4: bool = False):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if mxfp4 else {}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra).eval()


@pytest.fixture(scope="module", params=["float", "mxfp4"])
def pair(request, tmp_path_factory):
    mxfp4 = request.param == "mxfp4"
    folder = build_checkpoint(tmp_path_factory.mktemp("gpt-oss"), mxfp4=mxfp4)
    return load_checkpoint(folder, dtype="float32").model, _hf(folder, mxfp4)


def test_single_sequence_matches_transformers(pair):
    ours, hf = pair
    (prompt,) = random_prompts([21])
    assert paged_greedy(ours, [prompt], NEW_TOKENS)[0] == hf_greedy(hf, prompt, NEW_TOKENS)


def test_batched_varlen_prefill_then_decode(pair):
    ours, hf = pair
    prompts = random_prompts([3, 19, 1, 12], seed=2)
    assert paged_greedy(ours, prompts, NEW_TOKENS) == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def test_chunked_prefill(pair):
    ours, hf = pair
    prompts = random_prompts([26, 11], seed=3)
    got = paged_greedy(ours, prompts, NEW_TOKENS, prefill_chunks=3)
    assert got == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


LOGIT_CASES = {
    "float": {},
    "mxfp4": {"mxfp4": True},
    "tied-embeddings": {"tie_word_embeddings": True},
    # the rope settings' truncate flag left out: transformers' default (True) floors and ceils YaRN's ramp
    "yarn-truncated": {"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "original_max_position_embeddings": 4096, "rope_theta": 150000.0}},
}


@pytest.mark.parametrize("case", list(LOGIT_CASES))
@torch.inference_mode()
def test_logits_match_transformers(case, tmp_path):
    overrides = dict(LOGIT_CASES[case])
    mxfp4 = overrides.pop("mxfp4", False)
    folder = build_checkpoint(tmp_path, mxfp4=mxfp4, seed=1, **overrides)
    ours, hf = load_checkpoint(folder, dtype="float32").model, _hf(folder, mxfp4)
    (prompt,) = random_prompts([17], seed=5)
    allocate_kv_caches(ours, 8, 4)
    meta = AttentionMetadata.build([0], [len(prompt)], [[5, 2, 0, 7, 3]], 4)
    logits = ours.compute_logits(ours(torch.tensor(prompt), meta.positions(), meta))
    unbind_kv_caches(ours)
    torch.testing.assert_close(logits, hf(torch.tensor([prompt])).logits[0], rtol=1e-4, atol=1e-4)


async def test_served_by_the_engine_matches_transformers(tmp_path):
    """Through the backend's scheduler and runner: prompts chunked at 16 tokens, batched with decodes."""
    folder = build_checkpoint(tmp_path, mxfp4=True, seed=2)
    backend = PytorchBackend(EngineConfig(model=str(folder), dtype="float32", kv_cache_memory_gib=0.01, block_size=4,
                                          max_num_batched_tokens=16))
    assert backend.model_info.architecture == "GptOssForCausalLM"
    engine = AsyncEngine(backend)
    try:
        prompts = random_prompts([21, 3, 17], seed=6)
        greedy = GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        served = await asyncio.gather(*(collect(engine.generate(p, greedy)) for p in prompts))
    finally:
        await engine.close()
    hf = _hf(folder, mxfp4=True)
    assert [r.token_ids for r in served] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@torch.inference_mode()
def test_int8_quantization_packs_every_expert(tmp_path):
    """The experts are the backend's linear layers, so quantization at load reaches them (the router stays float)."""
    folder = build_checkpoint(tmp_path, seed=3)
    dense = load_checkpoint(folder, dtype="float32").model
    packed = load_checkpoint(folder, dtype="float32", quantization="int8").model
    for layer in packed.model.layers:
        assert type(layer.mlp.gate.weight) is torch.nn.Parameter
        for expert in layer.mlp.experts:
            assert type(expert.gate_up_proj.weight) is not torch.nn.Parameter
            assert type(expert.down_proj.weight) is not torch.nn.Parameter
    prompts = random_prompts([13, 5], seed=7)
    assert paged_greedy(packed, prompts, 4) == paged_greedy(dense, prompts, 4)


def test_dequantize_mxfp4_is_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 6, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 6, 2), generator=gen, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [experts, in, out]
    assert torch.equal(dequantize_mxfp4(blocks, scales), theirs.transpose(1, 2))
    weight = torch.randn(5, 64, generator=gen)
    restored = dequantize_mxfp4(*quantize_mxfp4(weight))
    assert (restored - weight).abs().max() <= weight.abs().max() / 6  # within half the widest e2m1 step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_clamped_swiglu_are_transformers(dtype):
    from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss

    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(5, 32, generator=gen) * 3).to(dtype)
    theirs, ours = hf_gpt_oss.GptOssRMSNorm(32, eps=1e-5), GptOssRMSNorm(32, 1e-5, select_ops("cpu", kind="reference"))
    with torch.no_grad():
        # a checkpoint's weight of x's dtype, which transformers keeps in float32
        theirs.weight.copy_(torch.randn(32, generator=gen).to(dtype))
        ours.weight.copy_(theirs.weight)
        assert torch.equal(ours.to(dtype)(x), theirs(x))
    experts = hf_gpt_oss.GptOssExperts(tiny_config(swiglu_limit=7.0))
    gate_up = (torch.randn(9, 128, generator=gen) * 6).to(dtype)  # interleaved, as the checkpoint's columns
    merged = torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=-1)  # [gate | up], as load_weights splits them
    assert torch.equal(ClampedSwiGLU(1.702, 7.0)(merged), experts._apply_gate(gate_up))


def test_other_quantization_methods_are_refused():
    config = tiny_config()
    config.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(NotImplementedError, match="quantization_config.quant_method 'gptq' is not supported"):
        GptOssForCausalLM(config, select_ops("cpu", kind="reference"))


def test_half_an_mxfp4_tensor_is_refused():
    blocks = torch.zeros(2, 8, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"only half of the MXFP4 tensors \['model.layers.0.mlp.experts.down_proj'\]"):
        list(llama_names([("model.layers.0.mlp.experts.down_proj_blocks", blocks)]))
