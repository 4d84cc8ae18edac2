"""The pooling contract: how a backend turns a prompt's hidden states into one embedding vector.

A backend declares per model whether and how it pools (`Backend.pooling`): mean over the prompt's tokens,
its first token (BERT's [CLS]) or its last token (decoder embedding models such as Qwen3-Embedding), with
or without L2 normalisation, and whether the vector may be truncated to fewer `dimensions` (Matryoshka
models); or "classify": a cross-encoder (a reranker) whose own head reads a pair of texts encoded as one
input and whose vector is its label logits, one relevance logit for the rerankers served (`relevance`). `Backend.embed` returns the pooled vectors; truncation is the core's (`truncate`). The
sentence-transformers files a checkpoint ships (`modules.json`, `1_Pooling/config.json`) say how it was
trained to pool (`sentence_transformers_pooling`). Pure Python: no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from core.errors import ContextTooLongError, InvalidRequestError, UnsupportedError

PoolingMethod = Literal["mean", "cls", "last", "classify"]
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class PoolingConfig:
    """How one model pools.

    :param method: "mean" (over the prompt's tokens), "cls" (the first token), "last" (the last token) or
        "classify" (a cross-encoder's classification head: the vector is its logits).
    :param normalize: L2-normalise each vector.
    :param truncatable: the model was trained so that a vector's first d dimensions are an embedding too
        (Matryoshka), so a request's `dimensions` may cut it.
    :param projections: folders (in the checkpoint) of sentence-transformers Dense modules that project the
        pooled vector, in order, before the normalisation (LaBSE's, distiluse's); the backend loads them.
    """

    method: PoolingMethod = "last"
    normalize: bool = True
    truncatable: bool = False
    projections: tuple[str, ...] = ()


@dataclass(frozen=True)
class Embedding:
    """One pooled vector and the number of prompt tokens it came from."""

    vector: Sequence[float]
    prompt_tokens: int


def sentence_transformers_pooling(folder: str | Path) -> PoolingConfig | None:
    """The pooling a sentence-transformers checkpoint declares (its Pooling module, its Dense projections and a
    Normalize module after them), or None when the folder has no modules.json; other modules are refused."""
    folder = Path(folder)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    unknown = sorted(set(kinds) - {"Transformer", "Pooling", "Dense", "Normalize"})
    if unknown:  # served without them, the vectors would not be the model's
        raise UnsupportedError(f"{folder}: the sentence-transformers modules {', '.join(unknown)} are not supported "
                               "(Transformer, Pooling, Dense and Normalize are)", param="model")
    projections = tuple(m.get("path", "") for m in sorted(modules, key=lambda m: m.get("idx", 0))
                        if m.get("type", "").rsplit(".", 1)[-1] == "Dense")
    method: PoolingMethod = "mean"
    if "Pooling" in kinds:
        pooling = json.loads((folder / kinds["Pooling"] / "config.json").read_text())
        method = next((mode for key, mode in _ST_MODES.items() if pooling.get(key)), "mean")  # type: ignore[assignment]
    matryoshka = (folder / "config_sentence_transformers.json")
    truncatable = matryoshka.is_file() and "matryoshka" in matryoshka.read_text().lower()
    return PoolingConfig(method=method, normalize="Normalize" in kinds, truncatable=truncatable, projections=projections)


def sentence_transformers_max_length(folder: str | Path) -> int | None:
    """The input limit a sentence-transformers checkpoint declares (`max_seq_length`), or None."""
    path = Path(folder) / "sentence_bert_config.json"
    return json.loads(path.read_text()).get("max_seq_length") if path.is_file() else None


def truncate(vector: Sequence[float], dimensions: int | None, config: PoolingConfig) -> list[float]:
    """The vector cut to its first `dimensions` (normalised again when the model normalises); a cut the
    model does not support, or one past its size, is a 400 naming `dimensions`."""
    if dimensions is None or dimensions == len(vector):
        return list(vector)
    if not config.truncatable:
        raise InvalidRequestError(f"this model's embeddings have {len(vector)} dimensions and cannot be truncated "
                                  "(it is not a Matryoshka model)", param="dimensions")
    if not 1 <= dimensions <= len(vector):
        raise InvalidRequestError(f"dimensions must be between 1 and {len(vector)}, got {dimensions}",
                                  param="dimensions")
    cut = list(vector[:dimensions])
    if not config.normalize:
        return cut
    norm = math.sqrt(sum(x * x for x in cut)) or 1.0
    return [x / norm for x in cut]


def relevance(logits: Sequence[float]) -> float:
    """A cross-encoder's score of a pair: the sigmoid of its one logit (sentence-transformers' CrossEncoder
    and vLLM score one-label rerankers so); a model of more labels is a 400 naming `model`."""
    if len(logits) != 1:
        raise InvalidRequestError(f"this cross-encoder has {len(logits)} labels; scores come from one-label "
                                  "rerankers", param="model")
    return 1.0 / (1.0 + math.exp(-logits[0]))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors (0 when either is zero)."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norms if norms else 0.0


def check_embedding_inputs(prompts: Sequence[Sequence[int]], max_model_len: int, vocab_size: int = 0) -> None:
    """An InvalidRequestError naming `input` for an empty prompt or a token id outside the vocabulary (when
    `vocab_size` is known), a ContextTooLongError for one past the context window."""
    for i, prompt in enumerate(prompts):
        if len(prompt) > max_model_len:
            raise ContextTooLongError(f"input {i} has {len(prompt)} tokens; this model takes at most {max_model_len}",
                                      param="input")
        if not prompt:
            raise InvalidRequestError(f"input {i} is empty", param="input")
        outside = [t for t in prompt if t < 0 or (vocab_size and t >= vocab_size)]
        if outside:
            raise InvalidRequestError(f"input {i}: token id {outside[0]} is outside the vocabulary [0, {vocab_size})",
                                      param="input")
