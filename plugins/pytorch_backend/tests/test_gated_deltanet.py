"""The gated DeltaNet hybrids on the pytorch backend (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo Hybrid): greedy
parity with transformers' generate (its torch fallbacks of the delta rule and the convolution, its cache on
the CPU) for one sequence, a batch of different lengths (one past the 64-token chunk of the chunked form), a
prefill split in chunks and one split in chunks shorter than the convolution; logits parity for the config
variants the released checkpoints use; the vision-language checkpoints' language model (the MoE one with
its experts stacked as released); the delta rule's segments against a token-by-token loop; one family
through the engine's continuous batching; and the settings refused at load."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn.functional import normalize

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.response import collect
from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.backend import PytorchBackend
from core_pytorch_backend.kernels import select_ops
from core_pytorch_backend.layers.recurrent import Segment
from core_pytorch_backend.loader import load_checkpoint
from core_pytorch_backend.models.gated_deltanet import delta_rule, recurrent_step
from core_pytorch_backend.models.qwen3_5 import Qwen3_5ForCausalLM
from core_pytorch_backend.models.qwen3_next import Qwen3NextForCausalLM
from core_pytorch_backend.native.library import available as native_kernels
from core_pytorch_backend.testing import (
    TINY_VOCAB,
    hf_greedy,
    paged_greedy,
    prompt_logits,
    random_prompts,
    reinit_,
    tiny_tokenizer,
)

L, F = "linear_attention", "full_attention"
NEW_TOKENS = 10
COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=257,
              eos_token_id=258, pad_token_id=259)
# two key heads for four value heads (each key head's q and k serve two value heads, as Qwen3-Next's 16 / 32)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=8)
# Qwen3.5's rotary: M-RoPE sections over the rotated quarter of each head
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
         "mrope_section": [2, 1, 1], "mrope_interleaved": True}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
NOPE = {"rope_type": "default", "rope_theta": None}
QWEN = dict(**LINEAR, head_dim=32)
CONFIGS = {
    # Qwen3-Next-80B's layout: three DeltaNet layers then attention (full_attention_interval 4), experts with
    # a shared expert, the second layer a dense MLP (mlp_only_layers)
    "qwen3-next": ("Qwen3NextConfig", dict(**QWEN, **MOE, intermediate_size=96, mlp_only_layers=[1])),
    "qwen3.5": ("Qwen3_5TextConfig", dict(**QWEN, intermediate_size=96, rope_parameters=MROPE)),
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", dict(**QWEN, **MOE, rope_parameters=MROPE)),
    # Olmo-Hybrid-7B's: no rotary, as many value heads as key heads, twice sigmoid(b) as the step size
    "olmo-hybrid": ("OlmoHybridConfig", dict(intermediate_size=96, rope_parameters=NOPE)),
}
PARITY = list(CONFIGS)
VARIANTS = {
    "qwen3-next-attention-bias": ("Qwen3NextConfig", dict(**QWEN, **MOE, attention_bias=True,
                                                          layer_types=[L, F, L, F], norm_topk_prob=False)),
    "olmo-hybrid-rope": ("OlmoHybridConfig", dict(intermediate_size=96, layer_types=[L, F, L, F], **LINEAR)),
    # a shared expert of size 0, whose empty tensors transformers saves (found by fuzzing configs: a load error)
    "qwen3-next-no-shared-expert": ("Qwen3NextConfig", dict(**QWEN, **{**MOE, "shared_expert_intermediate_size": 0},
                                                            intermediate_size=96)),
    "qwen3.5-moe-no-shared-expert": ("Qwen3_5MoeTextConfig", dict(**QWEN, **{**MOE, "shared_expert_intermediate_size": 0},
                                                                  rope_parameters=MROPE)),
    "olmo-hybrid-unit-beta": ("OlmoHybridConfig", dict(intermediate_size=96, rope_parameters=NOPE,
                                                       linear_allow_neg_eigval=False)),
}
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16)
PLACEHOLDERS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252,
                    vision_end_token_id=253)


def _config(kind: str, overrides: dict):
    import transformers

    return getattr(transformers, kind)(**{**COMMON, **overrides})


def _reinit(model: torch.nn.Module) -> None:
    """``reinit_``, then the DeltaNets' decay slow (A in [0.05, 1], dt_bias in [-4, -1]: about 4% a token),
    so what a sequence's memory held many tokens back (a chunk, a prefill chunk earlier) moves the tokens."""
    reinit_(model)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_((0.05 + 0.95 * torch.rand(param.shape, generator=gen)).log())
            elif name.endswith("dt_bias"):
                param.copy_(-4 + 3 * torch.rand(param.shape, generator=gen))


def _save(model: torch.nn.Module, folder: Path) -> Path:
    _reinit(model)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _checkpoint(name: str, cases: dict, folder: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return _save(AutoModelForCausalLM.from_config(_config(*cases[name]), dtype=torch.float32), folder)


class Pair:
    """Our model and transformers' on one checkpoint, transformers' greedy tokens kept by prompt."""

    def __init__(self, path: Path, hf_class=None):
        from transformers import AutoModelForCausalLM

        self.ours = load_checkpoint(path, dtype="float32").model
        self.hf = (hf_class or AutoModelForCausalLM).from_pretrained(path, dtype=torch.float32).eval()
        self.expected: dict[tuple[int, ...], list[int]] = {}

    def greedy(self, prompts: list[list[int]]) -> list[list[int]]:
        for prompt in prompts:
            if tuple(prompt) not in self.expected:
                self.expected[tuple(prompt)] = hf_greedy(self.hf, prompt, NEW_TOKENS)
        return [self.expected[tuple(p)] for p in prompts]

    def paged(self, prompts: list[list[int]], **options) -> list[list[int]]:
        return paged_greedy(self.ours, prompts, NEW_TOKENS, block_size=4, **options)

    def assert_logits_match(self, prompt: list[int]) -> None:
        with torch.inference_mode():
            expected = self.hf(torch.tensor([prompt])).logits[0]
        # float32 noise through four random layers: ~5e-5 of the logits' scale
        torch.testing.assert_close(prompt_logits(self.ours, prompt), expected, rtol=1e-4,
                                   atol=1e-4 * expected.abs().max().item())


@pytest.fixture(scope="module", params=PARITY)
def pair(request, tmp_path_factory) -> Pair:
    return Pair(_checkpoint(request.param, CONFIGS, tmp_path_factory.mktemp(request.param)))


def test_single_sequence_matches_transformers(pair):
    (prompt,) = random_prompts([9])
    assert paged_greedy(pair.ours, [prompt], NEW_TOKENS, block_size=16) == pair.greedy([prompt])


def test_batched_varlen_prefill_then_decode(pair):
    prompts = random_prompts([3, 70, 1, 9], seed=2)  # 70: two chunks of the chunked form
    assert pair.paged(prompts) == pair.greedy(prompts)


def test_chunked_prefill_continues_the_state(pair):
    prompts = random_prompts([70, 9], seed=2)[::-1]
    assert pair.paged(prompts, prefill_chunks=3) == pair.greedy(prompts)


def test_prefill_chunks_shorter_than_the_convolution(pair):
    """Chunks of 1-2 tokens: each continues the convolution's last 3 inputs, some from two chunks back."""
    prompts = random_prompts([9, 14], seed=6)
    assert pair.paged(prompts, prefill_chunks=7) == pair.greedy(prompts)


def test_logits_match_transformers(pair):
    pair.assert_logits_match(random_prompts([70], seed=5)[0])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_match_transformers(variant, tmp_path):
    """Attention biases, unnormalized routing (Qwen3-Next); OLMo Hybrid with rotary and with sigmoid(b)."""
    Pair(_checkpoint(variant, VARIANTS, tmp_path)).assert_logits_match(random_prompts([70], seed=5)[0])


def _vl_checkpoint(folder: Path, moe: bool) -> Path:
    """A Qwen3.5(-MoE) vision-language checkpoint (tied embeddings: the small Qwen3.5 models'); the MoE one's
    experts stacked as the released checkpoints keep them, and a multi-token-prediction tensor beside."""
    import transformers

    text = {**COMMON, **QWEN, "rope_parameters": MROPE, **(MOE if moe else {"intermediate_size": 96})}
    kind = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    config_class = getattr(transformers, "Qwen3_5MoeConfig" if moe else "Qwen3_5Config")
    config = config_class(text_config=text, vision_config=VISION, tie_word_embeddings=not moe, **PLACEHOLDERS)
    torch.manual_seed(0)
    _save(getattr(transformers, kind)(config).eval(), folder)
    if moe:
        _stack_experts(folder / "model.safetensors", config.text_config.num_experts)
    return folder


def _stack_experts(file: Path, experts: int) -> None:
    """Rewrite ``mlp.experts.{e}.*`` as ``mlp.experts.gate_up_proj`` [experts, 2 x size, hidden] (gate rows
    first) and ``mlp.experts.down_proj`` [experts, hidden, size]; add an ``mtp.*`` tensor."""
    tensors = load_file(file)
    layers = {name.split(".mlp.experts.")[0] for name in tensors if ".mlp.experts." in name}
    for layer in layers:
        take = [[tensors.pop(f"{layer}.mlp.experts.{e}.{p}.weight") for e in range(experts)]
                for p in ("gate_proj", "up_proj", "down_proj")]
        gate_up = [torch.cat(halves) for halves in zip(take[0], take[1], strict=True)]
        tensors[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{layer}.mlp.experts.down_proj"] = torch.stack(take[2])
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3.5", "qwen3.5-moe-stacked-experts"])
def test_vision_language_checkpoint_serves_its_language_model(moe, tmp_path):
    import transformers

    path = _vl_checkpoint(tmp_path, moe)
    architecture = json.loads((path / "config.json").read_text())["architectures"][0]
    pair = Pair(path, getattr(transformers, architecture))
    assert type(pair.ours).__name__ == architecture
    prompts = random_prompts([9, 70], seed=3)
    assert pair.paged(prompts, prefill_chunks=2) == pair.greedy(prompts)
    pair.assert_logits_match(prompts[1])


def test_text_checkpoint_under_the_language_model_names(tmp_path):
    """A Qwen3.5 text checkpoint whose tensors are named as the vision-language one's
    (``model.language_model.*``, which transformers' conversion reads too), with a vision tensor and a
    multi-token-prediction tensor beside."""
    path = _checkpoint("qwen3.5", CONFIGS, tmp_path / "plain")
    shutil.copytree(path, tmp_path / "renamed")
    tensors = {name.replace("model.", "model.language_model.", 1): tensor
               for name, tensor in load_file(path / "model.safetensors").items()}
    tensors.update({"model.visual.patch_embed.proj.weight": torch.zeros(2), "mtp.fc.weight": torch.zeros(2)})
    save_file(tensors, tmp_path / "renamed" / "model.safetensors", metadata={"format": "pt"})
    prompt = random_prompts([20], seed=7)[0]
    logits = [prompt_logits(load_checkpoint(tmp_path / name, dtype="float32").model, prompt)
              for name in ("plain", "renamed")]
    assert torch.equal(*logits)


async def test_engine_batches_prompt_chunks_beside_decode_rows(tmp_path):
    """Through the engine's continuous batching, prompts prefill 32 tokens a step beside other sequences'
    decode rows: steps of one-row and longer segments together, each from its own state slot."""
    from transformers import AutoModelForCausalLM

    path = _checkpoint("qwen3-next", CONFIGS, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[(11 * i + 7 * j + 3) % 250 for j in range(3 + 13 * i)] for i in range(6)]  # 3 to 68 tokens
    options = dict(dtype="float32", kv_cache_memory_gib=0.01, max_num_batched_tokens=32)
    engine = AsyncEngine(PytorchBackend(EngineConfig(model=str(path), **options)))
    greedy = GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    try:
        got = await asyncio.gather(*(collect(engine.generate(prompt, greedy)) for prompt in prompts))
    finally:
        await engine.close()
    assert [r.token_ids for r in got] == [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in prompts]


def _reference_rule(q, k, v, g, beta, memory):
    """transformers' ``torch_recurrent_gated_delta_rule``, token by token (one sequence: q, k [L, H, Dk])."""
    out = []
    for t in range(q.shape[0]):
        memory = memory * g[t].exp()[:, None, None]
        delta = (v[t] - (memory * k[t].unsqueeze(-1)).sum(-2)) * beta[t].unsqueeze(-1)
        memory = memory + k[t].unsqueeze(-1) * delta.unsqueeze(-2)
        out.append((memory * q[t].unsqueeze(-1)).sum(-2))
    return torch.stack(out), memory


def test_delta_rule_runs_each_segment_from_its_slot():
    """One step of decode rows, a continued 130-token run (three chunks) and fresh prompts (their slots NaN),
    as the engine batches them, against the token-by-token rule."""
    gen = torch.Generator().manual_seed(0)
    segs = (Segment(0, 1, 3, False), Segment(1, 130, 0, False), Segment(131, 1, 5, True),
            Segment(132, 5, 1, True), Segment(137, 1, 2, False))
    rows, heads, dk, dv = 138, 3, 8, 4
    q, k = (normalize(torch.randn(rows, heads, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(rows, heads, dv, generator=gen)
    g = -0.1 * torch.rand(rows, heads, generator=gen)
    beta = torch.rand(rows, heads, generator=gen)
    memory = torch.randn(6, heads, dk, dv, generator=gen)
    memory[[1, 5]] = float("nan")
    before = memory.clone()
    out = delta_rule(q, k, v, g, beta, memory, segs)
    for seg in segs:
        start = torch.zeros(heads, dk, dv) if seg.fresh else before[seg.slot]
        expected, final = _reference_rule(*(x[seg.rows] for x in (q, k, v, g, beta)), start)
        torch.testing.assert_close(out[seg.rows], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(memory[seg.slot], final, rtol=1e-5, atol=1e-5)
    assert torch.equal(memory[4], before[4])  # a slot no segment names is untouched


@pytest.mark.parametrize("native", [True, False])
def test_a_decode_step_matches_the_token_by_token_rule(native):
    """`recurrent_step` on the native kernel (csrc/delta_rule.c) and on torch's ops, for decode rows of
    Qwen3.5's head sizes, against the rule written out token by token; the memory is updated in place."""
    if native and native_kernels() is None:
        pytest.skip("the native CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(1)
    batch, heads, dk, dv = 5, 4, 128, 128
    q, k = (normalize(torch.randn(batch, heads, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(batch, heads, dv, generator=gen)
    g, beta = -torch.rand(batch, heads, generator=gen), torch.rand(batch, heads, generator=gen)
    memory = torch.randn(batch, heads, dk, dv, generator=gen)
    before = memory.clone()
    out, updated = recurrent_step(q, k, v, g, beta, memory, native=native)
    assert updated is memory
    for b in range(batch):
        expected, final = _reference_rule(*(x[b : b + 1] for x in (q, k, v, g, beta)), before[b])
        torch.testing.assert_close(out[b], expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(memory[b], final, rtol=1e-5, atol=1e-5)


def test_settings_it_does_not_run_are_refused():
    ops = select_ops("cpu")
    odd = _config("Qwen3NextConfig", dict(LINEAR, linear_num_value_heads=3, **MOE))
    with pytest.raises(NotImplementedError, match="linear_num_value_heads 3"):
        Qwen3NextForCausalLM(odd, ops)
    windowed = _config("Qwen3_5TextConfig", dict(LINEAR, layer_types=[L, "sliding_attention", L, F]))
    with pytest.raises(NotImplementedError, match="layer_types"):
        Qwen3_5ForCausalLM(windowed, ops)


def test_image_embeddings_are_refused():
    config = _config("Qwen3_5TextConfig", dict(LINEAR, rope_parameters=MROPE))
    model = Qwen3_5ForCausalLM(config, select_ops("cpu"))
    meta = AttentionMetadata.build([0], [2], [[0]], 4)
    with pytest.raises(NotImplementedError, match="image"):
        model(torch.tensor([1, 2]), meta.positions(), meta, (torch.tensor([0]), torch.zeros(1, 64)))
