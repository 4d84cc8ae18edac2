"""Bloom and MPT, the ALiBi decoders (models/bloom.py, models/mpt.py), against transformers on tiny random
checkpoints: greedy tokens of one sequence, of a batch of different lengths and of a prefill in chunks, and
every position's logits of a 40-token prompt (ALiBi's bias grows with the distance). MPT's slope rule against
transformers' own function, head counts that are not powers of two included (Bloom's: test_kernels_reference);
bloom-560m's names without ``transformer.``; MPT's fields that transformers reads and drops
(``alibi_bias_max``, ``logit_scale``) against transformers with them applied; the MPT layouts refused at
load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core_pytorch_backend import testing
from core_pytorch_backend.kernels import select_ops
from core_pytorch_backend.loader import build_model, load_checkpoint
from core_pytorch_backend.models import BUILTIN_ARCHITECTURES
from core_pytorch_backend.models.mpt import mpt_alibi_slopes

transformers = pytest.importorskip("transformers")


paged_greedy, hf_greedy, prompts_of = testing.paged_greedy, testing.hf_greedy, testing.random_prompts

IDS = dict(vocab_size=260, bos_token_id=257, eos_token_id=258, pad_token_id=259)
BLOOM = dict(hidden_size=96, n_layer=2, n_head=6, **IDS)
MPT = dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=128, **IDS)
UNTIED = dict(tie_word_embeddings=False)
CASES = {
    # bloom-560m's layout (the head tied to the embeddings) with 6 heads: two take the slopes past the largest
    # power of two, as 48 of bloom's 112 do
    "bloom-6-heads": ("bloom", BLOOM),
    "bloom-8-heads": ("bloom", {**BLOOM, "hidden_size": 128, "n_head": 8}),
    "bloom-residual-after-norm-untied": ("bloom", {**BLOOM, "apply_residual_connection_post_layernorm": True,
                                                   **UNTIED}),
    "mpt-7b-layout": ("mpt", MPT),
    # 6 heads (MPT's interleaved slopes), q/k/v clamped tight enough to bite, a softmax scale of its own
    "mpt-6-heads-clip-scale-untied": ("mpt", {**MPT, "d_model": 96, "n_heads": 6, **UNTIED,
                                              "attn_config": {"clip_qkv": 0.5, "softmax_scale": 0.3}}),
}


def _save(config, path: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    testing.reinit_with_layer_norms_(model)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(case) -> Path``, each made once."""
    made: dict[str, Path] = {}

    def make(case: str, **extra) -> Path:
        key = f"{case}{sorted(extra.items())}"
        if key not in made:
            family, fields = CASES[case]
            config_class = {"bloom": transformers.BloomConfig, "mpt": transformers.MptConfig}[family]
            made[key] = _save(config_class(**{**fields, **extra}), tmp_path_factory.mktemp(case))
        return made[key]

    return make


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, checkpoint):
    return testing.ours_and_transformers(checkpoint(request.param))


def test_single_sequence_matches_transformers(pair):
    ours, hf = pair
    (prompt,) = prompts_of([30])
    assert paged_greedy(ours, [prompt], block_size=16)[0] == hf_greedy(hf, prompt)


def test_batched_varlen_prefill_then_decode(pair):
    ours, hf = pair
    prompts = prompts_of([3, 21, 1, 8, 34], seed=2)
    assert paged_greedy(ours, prompts, block_size=4) == [hf_greedy(hf, p) for p in prompts]


def test_chunked_prefill_with_cached_prefix(pair):
    ours, hf = pair
    prompts = prompts_of([31, 7], seed=3)
    assert paged_greedy(ours, prompts, block_size=4, prefill_chunks=3) == [hf_greedy(hf, p) for p in prompts]


@torch.inference_mode()
def test_logits_match_transformers(pair):
    ours, hf = pair
    (prompt,) = prompts_of([40], seed=5)
    testing.assert_logits_close(testing.prompt_logits(ours, prompt), hf(torch.tensor([prompt])).logits[0])


@pytest.mark.parametrize("bias_max", [8, 4, 16])
@pytest.mark.parametrize("heads", [1, 3, 4, 6, 7, 8, 12, 32, 48])
def test_mpt_slopes_are_transformers(heads, bias_max):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    alibi = build_mpt_alibi_tensor(heads, 2, bias_max)  # [heads, 1, 2]: -slope, then 0 for the last key
    assert torch.equal(mpt_alibi_slopes(heads, bias_max), -alibi[:, 0, 0])


@torch.inference_mode()
def test_bloom_560m_names_without_prefix(checkpoint, tmp_path):
    """bloom-560m's files name ``word_embeddings.weight``, ``h.0...``, ``ln_f.weight`` (bloom's and
    transformers' own saves put ``transformer.`` in front)."""
    path = checkpoint("bloom-6-heads")
    tensors = load_file(path / "model.safetensors")
    assert all(name.startswith("transformer.") for name in tensors)
    bare = tmp_path / "bloom-560m-names"
    bare.mkdir()
    (bare / "config.json").write_text((path / "config.json").read_text())
    save_file({name.removeprefix("transformer."): t for name, t in tensors.items()},
              bare / "model.safetensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    (prompt,) = prompts_of([20], seed=6)
    testing.assert_logits_close(testing.prompt_logits(load_checkpoint(bare, dtype="float32").model, prompt),
                         hf(torch.tensor([prompt])).logits[0])


@torch.inference_mode()
def test_mpt_alibi_bias_max_follows_mosaicml(checkpoint, monkeypatch):
    """transformers' MPT builds its slopes with alibi_bias_max 8 whatever the config says (every released
    checkpoint's value); MosaicML's code, served here, takes the config's: transformers with it passed on."""
    from transformers.models.mpt.modeling_mpt import MptModel, build_mpt_alibi_tensor

    path = checkpoint("mpt-6-heads-clip-scale-untied", attn_config={"alibi_bias_max": 4})
    ours = load_checkpoint(path, dtype="float32").model
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    (prompt,) = prompts_of([40], seed=7)
    as_released = hf(torch.tensor([prompt])).logits[0]

    def with_bias_max(self, heads, length, alibi_bias_max=8, device=None):
        return build_mpt_alibi_tensor(heads, length, self.config.attn_config.alibi_bias_max, device)

    monkeypatch.setattr(MptModel, "build_mpt_alibi_tensor", with_bias_max)
    expected = hf(torch.tensor([prompt])).logits[0]
    assert not torch.allclose(expected, as_released, atol=1e-2)  # the field changes the model
    testing.assert_logits_close(testing.prompt_logits(ours, prompt), expected)
    prompts = prompts_of([30, 9], seed=8)
    assert paged_greedy(ours, prompts, block_size=4, prefill_chunks=2) == [hf_greedy(hf, p) for p in prompts]


@pytest.mark.parametrize("scale, factor", [(0.25, 0.25), ("inv_sqrt_d_model", 64 ** -0.5)])
@torch.inference_mode()
def test_mpt_logit_scale_multiplies_the_logits(scale, factor, checkpoint):
    """MosaicML's logit_scale (transformers' MPT drops it): the logits times it, or 1 / sqrt(d_model)."""
    path = checkpoint("mpt-7b-layout", logit_scale=scale)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    (prompt,) = prompts_of([12], seed=9)
    testing.assert_logits_close(testing.prompt_logits(load_checkpoint(path, dtype="float32").model, prompt),
                         hf(torch.tensor([prompt])).logits[0] * factor)


def _build_mpt(**fields):
    config = transformers.MptConfig(**{**MPT, **fields}, architectures=["MPTForCausalLM"])
    return build_model(config, BUILTIN_ARCHITECTURES, select_ops("cpu", "reference"), "cpu", torch.float32)


@pytest.mark.parametrize("fields, named", [
    (dict(attn_config={"attn_type": "multiquery_attention"}), "attn_config.attn_type"),
    (dict(attn_config={"prefix_lm": True}), "attn_config.prefix_lm"),
    (dict(attn_config={"alibi": False}), "attn_config.alibi"),
    (dict(attn_config={"qk_ln": True}), "attn_config.qk_ln"),
    (dict(attn_config={"rope": True}), "attn_config.rope"),
    (dict(attn_config={"sliding_window_size": 64}), "attn_config.sliding_window_size"),
    (dict(no_bias=False), "no_bias"),
    (dict(expansion_ratio=2), "expansion_ratio"),
    (dict(norm_type="rmsnorm"), "norm_type"),
    (dict(ffn_config={"ffn_type": "mptglu"}), "ffn_config"),
])
def test_mpt_layouts_transformers_does_not_build_are_refused(fields, named):
    with pytest.raises(NotImplementedError, match=f"MPT: {named}="):
        _build_mpt(**fields)


def test_mpt_learned_positions_in_the_checkpoint_are_refused():
    model = _build_mpt()
    with pytest.raises(NotImplementedError, match="transformer.wpe.weight"):
        model.load_weights([("transformer.wpe.weight", torch.zeros(128, 64))])


def test_mpt_serves_max_seq_len_positions(checkpoint):
    assert load_checkpoint(checkpoint("mpt-7b-layout"), dtype="float32").max_model_len == MPT["max_seq_len"]
