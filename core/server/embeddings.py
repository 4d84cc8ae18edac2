"""The pooling routes: POST /v1/embeddings, /v1/score and /v1/rerank, over `AsyncEngine.embed` (a score is the
cosine similarity of two embeddings), or, for a cross-encoder, `AsyncEngine.classify_pairs` (a score is its
relevance of the pair read as one input)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request

from core.pooling import Embedding, cosine, relevance, truncate
from core.server import embeddings_protocol as ep
from core.server import openai_translate as tr
from core.server.serving import check_model, parse_body, state_of, until_disconnected

router = APIRouter()


async def _embed(request: Request, inputs: Sequence[str | list[int]]) -> list[Embedding]:
    return await until_disconnected(request, state_of(request).engine.embed(inputs))


def _cross_encoder(request: Request) -> bool:
    pooling = state_of(request).engine.backend.pooling
    return pooling is not None and pooling.method == "classify"


async def _pair_scores(request: Request, pairs: Sequence[tuple[str, str]]) -> tuple[list[float], int]:
    """A cross-encoder's relevance of each pair, and the prompt tokens they took."""
    results = await until_disconnected(request, state_of(request).engine.classify_pairs(pairs))
    return [relevance(r.vector) for r in results], sum(r.prompt_tokens for r in results)


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> dict[str, Any]:
    """One embedding per input, as floats or base64; `dimensions` cuts a Matryoshka model's vectors."""
    state = state_of(request)
    req = await parse_body(request, ep.EmbeddingRequest)
    check_model(state, req.model)
    results = await _embed(request, tr.completion_prompts(req.input, param="input"))  # a prompt's shapes
    pooling = state.engine.backend.pooling
    assert pooling is not None  # engine.embed refused otherwise
    vectors = [ep.encode_vector(truncate(r.vector, req.dimensions, pooling), req.encoding_format) for r in results]
    return ep.embedding_response(f"embd-{uuid.uuid4().hex}", state.model_name, vectors,
                                 sum(r.prompt_tokens for r in results))


@router.post("/v1/score")
async def score(request: Request) -> dict[str, Any]:
    """The similarity of text_1 to each text_2 (or of each pair)."""
    state = state_of(request)
    req = await parse_body(request, ep.ScoreRequest)
    check_model(state, req.model)
    pairs = ep.score_pairs(req.text_1, req.text_2)
    first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if _cross_encoder(request):
        scores, tokens = await _pair_scores(request, [(first[i], second[j]) for i, j in pairs])
        return ep.score_response(f"score-{uuid.uuid4().hex}", int(time.time()), state.model_name, scores, tokens)
    results = await _embed(request, [*first, *second])
    a, b = results[: len(first)], results[len(first):]
    scores = [cosine(a[i].vector, b[j].vector) for i, j in pairs]
    return ep.score_response(f"score-{uuid.uuid4().hex}", int(time.time()), state.model_name, scores,
                             sum(r.prompt_tokens for r in results))


@router.post("/v1/rerank")
async def rerank(request: Request) -> dict[str, Any]:
    """The documents ordered by their similarity to the query (the best top_n)."""
    state = state_of(request)
    req = await parse_body(request, ep.RerankRequest)
    check_model(state, req.model)
    if _cross_encoder(request):
        scores, tokens = await _pair_scores(request, [(req.query, document) for document in req.documents])
        return ep.rerank_response(f"rerank-{uuid.uuid4().hex}", state.model_name, req.documents, scores, req.top_n,
                                  tokens)
    [query, *documents] = await _embed(request, [req.query, *req.documents])
    scores = [cosine(query.vector, d.vector) for d in documents]
    return ep.rerank_response(f"rerank-{uuid.uuid4().hex}", state.model_name, req.documents, scores, req.top_n,
                              query.prompt_tokens + sum(d.prompt_tokens for d in documents))
