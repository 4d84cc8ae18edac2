"""Embedding and scoring request bodies (OpenAI's /v1/embeddings, vLLM's /v1/score and /v1/rerank) and
the pure translations of their inputs and outputs. A score is the cosine similarity of two embeddings
(what vLLM computes for an embedding model), or a cross-encoder's relevance of the pair read in one pass."""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.errors import InvalidRequestError


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: a string, a list of strings, token ids, or a list of token-id lists."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class ScoreRequest(BaseModel):
    """POST /v1/score (vLLM): text_1 against each text_2 (one to many), or pairwise (equal lists)."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(BaseModel):
    """POST /v1/rerank (vLLM, Jina/Cohere shape): documents ordered by relevance to the query."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = None


def encode_vector(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    """A vector as floats, or (base64) its little-endian float32 bytes, as OpenAI encodes it."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return list(vector)


def embedding_response(response_id: str, model: str, vectors: Sequence[list[float] | str],
                       prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's embedding list."""
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
    return {"id": response_id, "object": "list", "model": model, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[int, int]]:
    """Index pairs into (text_1 list, text_2 list): one to many when text_1 is one text, else pairwise."""
    first = [text_1] if isinstance(text_1, str) else text_1
    second = [text_2] if isinstance(text_2, str) else text_2
    if not first or not second:
        raise InvalidRequestError("text_1 and text_2 must not be empty", param="text_1" if not first else "text_2")
    if len(first) == 1:
        return [(0, j) for j in range(len(second))]
    if len(first) != len(second):
        raise InvalidRequestError(f"text_1 has {len(first)} texts and text_2 {len(second)}: pairs need as many "
                                  "of each (or one text_1)", param="text_2")
    return [(i, i) for i in range(len(first))]


def score_response(response_id: str, created: int, model: str, scores: Sequence[float],
                   prompt_tokens: int) -> dict[str, Any]:
    """vLLM's score list."""
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return {"id": response_id, "object": "list", "created": created, "model": model, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def rerank_response(response_id: str, model: str, documents: Sequence[str], scores: Sequence[float],
                    top_n: int | None, prompt_tokens: int) -> dict[str, Any]:
    """vLLM's rerank body: the top_n documents by relevance, best first."""
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[: top_n if top_n else len(documents)]
    results = [{"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]} for i in order]
    return {"id": response_id, "model": model, "usage": {"total_tokens": prompt_tokens}, "results": results}
