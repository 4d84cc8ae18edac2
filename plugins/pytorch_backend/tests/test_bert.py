"""The BERT encoder against transformers' BertModel on a tiny random checkpoint: hidden states of a padded
batch, each pooling method, and the backend factory's choice of the encoder backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.config import EngineConfig
from core.pooling import PoolingConfig
from core_pytorch_backend.backend_choice import make_backend
from core_pytorch_backend.encoder_backend import PytorchEncoderBackend
from core_pytorch_backend.loader import load_checkpoint
from core_pytorch_backend.pooling_runner import PoolingRunner

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-bert")
    transformers.BertModel(config).eval().save_pretrained(path)
    return path


PROMPTS = [[2, 5, 7, 9, 3], [2, 11, 3], [2, 4, 4, 4, 4, 4, 4, 3]]


def _right_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one right-padded batch of ids, and its attention mask (1 on the real tokens)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [pad] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    return ids, mask


def _reference(path: Path) -> list[torch.Tensor]:
    model = transformers.BertModel.from_pretrained(path).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]


def test_hidden_states_match_transformers_in_a_padded_batch(tiny_bert: Path):
    model = load_checkpoint(tiny_bert, dtype="float32").model
    ids, mask = _right_padded(PROMPTS, pad=0)
    with torch.no_grad():
        hidden = model(ids, mask)
    for i, expected in enumerate(_reference(tiny_bert)):
        torch.testing.assert_close(hidden[i, :len(PROMPTS[i])], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["mean", "cls", "last"])
def test_each_pooling_method(tiny_bert: Path, method: str):
    model = load_checkpoint(tiny_bert, dtype="float32").model
    runner = PoolingRunner(model, PoolingConfig(method, normalize=True), torch.device("cpu"), max_batch_tokens=10)
    vectors = runner.run(PROMPTS)  # 10 tokens a batch: several batches
    for vector, hidden in zip(vectors, _reference(tiny_bert), strict=True):
        pooled = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[method]
        torch.testing.assert_close(torch.tensor(vector), torch.nn.functional.normalize(pooled, dim=0), atol=1e-5,
                                   rtol=1e-5)
    runner.close()


def test_the_factory_serves_an_encoder_on_the_pooling_path(tiny_bert: Path):
    backend = make_backend(EngineConfig(model=str(tiny_bert)))
    assert isinstance(backend, PytorchEncoderBackend) and not backend.supports_generation
    assert backend.pooling == PoolingConfig("mean", normalize=True)  # no sentence-transformers files
    assert backend.model_info.max_model_len == 64


@pytest.mark.parametrize("family", ["XLMRoberta", "Roberta"])
def test_roberta_encoders_match_transformers_in_a_padded_batch(family: str, tmp_path: Path):
    """RoBERTa's positions start after the padding token's (pad_token_id 1: position 2 first), and its
    checkpoints are prefixed ``roberta.``: the same hidden states as transformers' in a right-padded batch, and
    inputs as long as the learned positions past the offset allow."""
    config = getattr(transformers, f"{family}Config")(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=66, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    reference = getattr(transformers, f"{family}Model")(config).eval()
    reference.save_pretrained(tmp_path)
    loaded = load_checkpoint(tmp_path, dtype="float32")
    assert loaded.max_model_len == 64
    prompts = [[0, 5, 7, 9, 2], [0, 11, 2], [0] + [4] * 62 + [2]]
    ids, mask = _right_padded(prompts, pad=1)
    with torch.no_grad():
        hidden = loaded.model(ids, mask)
        expected = reference(ids, attention_mask=mask).last_hidden_state
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(hidden[i, :len(prompt)], expected[i, :len(prompt)], atol=1e-5, rtol=1e-5)


def test_a_roberta_cross_encoder_gives_transformers_logits_in_a_padded_batch(tmp_path: Path):
    """XLMRobertaForSequenceClassification (the BGE rerankers): the first token's state through the
    classification head (dense, tanh, out_proj); pairs are one input (``<s> a </s></s> b </s>``)."""
    config = transformers.XLMRobertaConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=66, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2, num_labels=1)
    torch.manual_seed(0)
    reference = transformers.XLMRobertaForSequenceClassification(config).eval()
    reference.save_pretrained(tmp_path)
    loaded = load_checkpoint(tmp_path, dtype="float32")
    assert loaded.model.pooling.method == "classify"
    prompts = [[0, 5, 7, 2, 2, 9, 2], [0, 11, 2, 2, 12, 2], [0] + [4] * 20 + [2, 2, 6, 2]]
    ids, mask = _right_padded(prompts, pad=1)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids, mask), reference(ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention, biases", [("eager", False), ("sdpa", True)])
def test_modernbert_matches_transformers_in_a_padded_batch(attention: str, biases: bool, tmp_path: Path):
    """ModernBERT (gte-modernbert, modernbert-embed): pre-norm layers alternating global attention and a
    bidirectional window of local_attention / 2 tokens each side, each with its own rotary base, and a GeGLU
    MLP: transformers' hidden states on the real tokens of a right-padded batch, inputs longer than the window
    and as long as max_position_embeddings; a wrong window or rotary base does not pass."""
    config = transformers.ModernBertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=8, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, initializer_range=0.2,
        global_rope_theta=500.0, local_rope_theta=20.0, norm_bias=biases, attention_bias=biases, mlp_bias=biases,
        attn_implementation=attention)
    assert config.layer_types == ["full_attention", "sliding_attention", "full_attention"]
    torch.manual_seed(0)
    reference = transformers.ModernBertModel(config).eval()
    with torch.no_grad():  # norms and biases away from 1 and 0, so that each one counts
        for name, param in reference.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    reference.save_pretrained(tmp_path)
    loaded = load_checkpoint(tmp_path, dtype="float32")
    assert loaded.max_model_len == 64
    prompts = [[1, 5, 7, 9, 2], [1] + list(range(3, 20)) + [2], [1] + [i * 7 % 90 + 3 for i in range(62)] + [2]]
    ids, mask = _right_padded(prompts, pad=0)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).last_hidden_state

    def check(model) -> None:
        with torch.no_grad():
            hidden = model(ids, mask)
        for i, prompt in enumerate(prompts):
            torch.testing.assert_close(hidden[i, :len(prompt)], expected[i, :len(prompt)], atol=1e-5, rtol=1e-5)

    model = loaded.model
    check(model)
    window, inv_freq = model.window, dict(model.inv_freq)
    for wrong in (window - 1, window + 1, 10**6):  # the window's edge, and no window at all
        model.window = wrong
        with pytest.raises(AssertionError):
            check(model)
    model.window = window
    for kinds in (("full_attention", "full_attention"), ("sliding_attention", "sliding_attention"),
                  ("sliding_attention", "full_attention")):  # one base for both kinds of layer, or swapped
        model.inv_freq = {"full_attention": inv_freq[kinds[0]], "sliding_attention": inv_freq[kinds[1]]}
        with pytest.raises(AssertionError):
            check(model)
    model.inv_freq = inv_freq
    check(model)


@pytest.mark.parametrize("architecture", ["MPNetModel", "MPNetForMaskedLM"])
def test_mpnet_encoders_match_transformers_in_a_padded_batch(architecture: str, tmp_path: Path):
    """MPNet (all-mpnet-base-v2, whose config names MPNetForMaskedLM): BERT's layers plus a relative position
    bias shared by all layers (T5-style buckets, made large here so that a wrong one shows), positions from 2,
    no token types; the MLM checkpoint's ``mpnet.`` prefix and head are dropped."""
    config = transformers.MPNetConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=66, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    reference = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        reference.base_model.encoder.relative_attention_bias.weight.normal_(0, 1)
    reference.save_pretrained(tmp_path)
    loaded = load_checkpoint(tmp_path, dtype="float32")
    assert loaded.max_model_len == 64
    prompts = [[0, 5, 7, 9, 2], [0, 11, 2], [0] + [3 + i % 90 for i in range(62)] + [2]]  # distances past 8
    ids, mask = _right_padded(prompts, pad=1)
    with torch.no_grad():
        hidden = loaded.model(ids, mask)
        expected = reference.base_model(ids, attention_mask=mask).last_hidden_state
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(hidden[i, :len(prompt)], expected[i, :len(prompt)], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("activation", "sinusoidal"), [("gelu", False), ("relu", True)])
def test_distilbert_encoder_matches_transformers_in_a_padded_batch(activation: str, sinusoidal: bool,
                                                                    tmp_path: Path):
    """DistilBERT (msmarco-distilbert, distiluse's transformer): BERT's layers under DistilBERT's names,
    positions from 0, no token types, LayerNorm epsilon 1e-12; sinusoidal positions are a stored table."""
    config = transformers.DistilBertConfig(vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                           max_position_embeddings=66, pad_token_id=0, activation=activation,
                                           sinusoidal_pos_embds=sinusoidal)
    torch.manual_seed(0)
    reference = transformers.DistilBertModel(config).eval()
    reference.save_pretrained(tmp_path)
    loaded = load_checkpoint(tmp_path, dtype="float32")
    assert loaded.max_model_len == 66
    prompts = [[2, 5, 7, 9, 3], [2, 11, 3], [2] + [4 + i % 90 for i in range(64)] + [3]]
    ids, mask = _right_padded(prompts, pad=0)
    with torch.no_grad():
        hidden = loaded.model(ids, mask)
        expected = reference(ids, attention_mask=mask).last_hidden_state
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(hidden[i, :len(prompt)], expected[i, :len(prompt)], atol=1e-5, rtol=1e-5)


def test_dense_projections_map_the_pooled_vector_before_the_normalisation(tiny_bert: Path, tmp_path: Path):
    """LaBSE's layout: [CLS] pooling, a Dense module (tanh) and Normalize: the backend's vectors are
    normalize(tanh(W cls + b)) of transformers' [CLS] state; a decoder's Dense modules are refused."""
    import json
    import shutil

    from safetensors.torch import save_file

    folder = tmp_path / "labse-like"
    shutil.copytree(tiny_bert, folder)
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
               {"idx": 3, "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    (folder / "2_Dense").mkdir()
    (folder / "2_Dense" / "config.json").write_text(json.dumps({
        "in_features": 32, "out_features": 16, "bias": True, "activation_function": "torch.nn.modules.activation.Tanh"}))
    weight, bias = torch.randn(16, 32, generator=torch.Generator().manual_seed(3)), torch.randn(16) * 0.1
    save_file({"linear.weight": weight, "linear.bias": bias}, str(folder / "2_Dense" / "model.safetensors"))
    backend = make_backend(EngineConfig(model=str(folder)))
    assert backend.pooling.projections == ("2_Dense",)
    vectors = backend.runner.run(PROMPTS)
    for vector, hidden in zip(vectors, _reference(folder), strict=True):
        expected = torch.nn.functional.normalize(torch.tanh(hidden[0] @ weight.T + bias), dim=-1)
        torch.testing.assert_close(torch.tensor(vector), expected, atol=1e-5, rtol=1e-5)
    backend.runner.close()
