"""GPT-Neo (models/gpt_neo.py) against transformers on tiny random checkpoints whose local layers see a window
of 5 or 7 positions and whose prompts run past it: greedy tokens of one sequence, of a batch of different
lengths and of a prefill in chunks, every position's logits (which a window off by one, or a scaled score,
changes), older checkpoints' mask buffers, and attention types other than global and local refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core_pytorch_backend import testing
from core_pytorch_backend.kernels import select_ops
from core_pytorch_backend.loader import build_model, load_checkpoint
from core_pytorch_backend.models import BUILTIN_ARCHITECTURES

transformers = pytest.importorskip("transformers")


paged_greedy, hf_greedy, prompts_of = testing.paged_greedy, testing.hf_greedy, testing.random_prompts

UNTIED = dict(tie_word_embeddings=False)
NEO = dict(vocab_size=260, bos_token_id=257, eos_token_id=258, pad_token_id=259, hidden_size=64, num_layers=2,
           num_heads=4, intermediate_size=128, max_position_embeddings=128, window_size=5,
           attention_types=[[["global", "local"], 1]])
CASES = {
    "gpt-neo-125m-layout": NEO,  # global and local layers by turns, the head tied to wte
    "local-first-window-7-untied-gelu": {**NEO, "attention_types": [[["local", "global"], 2]],
                                         "num_layers": 4, "window_size": 7, "activation_function": "gelu",
                                         **UNTIED},
}


def _save(fields: dict, path: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.GPTNeoConfig(**fields)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    testing.reinit_with_layer_norms_(model)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    path = _save(CASES[request.param], tmp_path_factory.mktemp(request.param))
    ours = load_checkpoint(path, dtype="float32").model
    return path, ours, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_local_layers_take_the_window(case):
    path, ours, hf = case
    windows = [layer.attn.attn.sliding_window for layer in ours.model.layers]
    assert windows == [hf.config.window_size if t == "local" else None for t in hf.config.attention_layers]


def test_single_sequence_matches_transformers(case):
    _, ours, hf = case
    (prompt,) = prompts_of([23])
    assert paged_greedy(ours, [prompt], block_size=16)[0] == hf_greedy(hf, prompt)


def test_batched_varlen_prefill_then_decode(case):
    _, ours, hf = case
    prompts = prompts_of([3, 13, 1, 8, 17], seed=2)
    assert paged_greedy(ours, prompts, block_size=4) == [hf_greedy(hf, p) for p in prompts]


def test_chunked_prefill_with_cached_prefix(case):
    _, ours, hf = case
    prompts = prompts_of([26, 7], seed=3)
    assert paged_greedy(ours, prompts, block_size=4, prefill_chunks=3) == [hf_greedy(hf, p) for p in prompts]


@torch.inference_mode()
def test_logits_match_transformers(case):
    _, ours, hf = case
    (prompt,) = prompts_of([30], seed=5)
    testing.assert_logits_close(testing.prompt_logits(ours, prompt), hf(torch.tensor([prompt])).logits[0])


@torch.inference_mode()
def test_older_checkpoints_mask_buffers_are_skipped(case, tmp_path):
    """gpt-neo-125m's files keep each layer's mask (``attn.attention.bias``) and its fill value
    (``masked_bias``)."""
    path, ours, _ = case
    tensors = load_file(path / "model.safetensors")
    for i in range(ours.config.num_hidden_layers):
        tensors[f"transformer.h.{i}.attn.attention.bias"] = torch.ones(1, 1, 128, 128, dtype=torch.bool)
        tensors[f"transformer.h.{i}.attn.attention.masked_bias"] = torch.tensor(-1e9)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors")
    (prompt,) = prompts_of([12], seed=6)
    torch.testing.assert_close(testing.prompt_logits(load_checkpoint(tmp_path, dtype="float32").model, prompt),
                               testing.prompt_logits(ours, prompt), rtol=0, atol=0)


def test_attention_types_other_than_global_and_local_are_refused():
    config = transformers.GPTNeoConfig(**{**NEO, "attention_types": [[["global", "sparse"], 1]]})
    with pytest.raises(NotImplementedError, match=r"attention_types names \['sparse'\]"):
        build_model(config, BUILTIN_ARCHITECTURES, select_ops("cpu", "reference"), "cpu", torch.float32)
