"""The pure pieces without a server: request translation, finish reasons, SSE, error bodies, metrics;
plus the app in-process for what a subprocess cannot show (a dead engine, an unexpected exception)."""

from __future__ import annotations

import threading

import httpx
import pytest

from core.backend import TokenLogprob
from core.engine import AsyncEngine
from core.errors import ContextTooLongError, EngineSleepingError, InvalidRequestError
from core.server import anthropic_protocol as ap
from core.server import openai_translate as tr
from core.server.app import build_app
from core.server.errors import Protocol, core_error_body, param_of, renamed_params, validation_to_core_error
from core.server.metrics import Histogram
from core.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from core.server.serving import collect_all, merge
from core.server.sse import DONE, sse_data, sse_event
from core.testing.fake import FakeBackend
from core.testing.parse import parse_metrics, parse_sse

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def test_unsent_fields_stay_unset_so_model_defaults_apply():
    config = tr.chat_generation_config(chat())
    assert (config.temperature, config.top_p, config.top_k, config.min_p, config.repetition_penalty) == (None,) * 5
    assert config.max_new_tokens is None and config.n == 1 and not config.logprobs


def test_chat_fields_map_to_generation_config():
    config = tr.chat_generation_config(chat(
        max_tokens=5, max_completion_tokens=7, temperature=0.5, top_p=0.9, n=2, stop="END", seed=3, logprobs=True,
        top_logprobs=4, presence_penalty=0.1, frequency_penalty=0.2, logit_bias={"12": 1.5}, top_k=40, min_p=0.1,
        repetition_penalty=1.1, ignore_eos=True, min_tokens=2, stop_token_ids=[9], skip_special_tokens=False,
        include_stop_str_in_output=True))
    assert config.max_new_tokens == 7 and config.stop == ("END",) and config.logit_bias == {12: 1.5}
    assert (config.top_logprobs, config.top_k, config.min_new_tokens, config.stop_token_ids) == (4, 40, 2, (9,))
    assert config.ignore_eos and not config.skip_special_tokens and config.include_stop_str_in_output


def test_completion_logprobs_is_the_number_of_alternatives():
    config = tr.completion_generation_config(CompletionRequest.model_validate({"prompt": "x", "logprobs": 3}))
    assert config.logprobs and config.top_logprobs == 3


@pytest.mark.parametrize(("fields", "param"), [({"max_tokens": 0}, "max_tokens"),
                                               ({"max_completion_tokens": 0}, "max_completion_tokens"),
                                               ({"min_tokens": -1}, "min_tokens")])
def test_engine_field_names_become_request_field_names(fields, param):
    req = chat(**fields)
    with pytest.raises(InvalidRequestError) as info, renamed_params(tr.chat_param_names(req)):
        tr.chat_generation_config(req)
    assert info.value.param == param and param in info.value.message


def test_stream_options_need_stream():
    with pytest.raises(InvalidRequestError, match="stream_options"):
        tr.chat_generation_config(chat(stream_options={"include_usage": True}))


def test_completion_prompts():
    assert tr.completion_prompts("a") == ["a"]
    assert tr.completion_prompts([1, 2]) == [[1, 2]]
    assert tr.completion_prompts(["a", "b"]) == ["a", "b"]
    assert tr.completion_prompts([[1], [2]]) == [[1], [2]]


def test_finish_reason_mapping():
    assert [tr.finish_reason(r) for r in ("stop", "length", "abort", None)] == ["stop", "length", "abort", None]
    assert tr.finish_reason("stop", tool_calls=True) == "tool_calls"
    assert ap.stop_reason("stop", 257, None) == ("end_turn", None)
    assert ap.stop_reason("stop", "##", ["##"]) == ("stop_sequence", "##")
    assert ap.stop_reason("length", None, None) == ("max_tokens", None)


def test_logprob_formats():
    entries = [TokenLogprob(104, -0.1, ((104, -0.1), (105, -2.0)))]
    chat_lp = tr.chat_logprobs(entries, lambda ids: bytes(ids).decode())
    assert chat_lp == {"content": [{"token": "h", "logprob": -0.1, "bytes": [104], "top_logprobs": [
        {"token": "h", "logprob": -0.1, "bytes": [104]}, {"token": "i", "logprob": -2.0, "bytes": [105]}]}]}
    legacy = tr.completion_logprobs(entries * 2, lambda ids: bytes(ids).decode(), offset=3)
    assert legacy["text_offset"] == [3, 4] and legacy["top_logprobs"][0] == {"h": -0.1, "i": -2.0}
    assert tr.chat_logprobs(None, str) is None


def test_usage_shape():
    assert tr.usage(3, 4, 1) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                 "prompt_tokens_details": {"cached_tokens": 1}}


def test_sse_formatting():
    assert sse_data({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert sse_event("ping", {"type": "ping"}) == 'event: ping\ndata: {"type":"ping"}\n\n'
    assert parse_sse(sse_event("x", 1) + sse_data(2) + DONE) == [("x", "1"), (None, "2"), (None, "[DONE]")]


def test_error_bodies():
    exc = EngineSleepingError({"weights"})
    assert core_error_body(Protocol.OPENAI, exc)["error"]["code"] == "sleeping"
    body = core_error_body(Protocol.ANTHROPIC, exc)
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    too_long = ContextTooLongError("the prompt is too long", param="prompt")
    assert core_error_body(Protocol.OPENAI, too_long)["error"]["code"] == "context_length_exceeded"  # OpenAI's
    assert param_of(("body", "prompt", "list[int]", 1)) == "prompt.1"
    assert validation_to_core_error([{"type": "json_invalid", "loc": (), "msg": "x"}]).param == "body"


def test_histogram_is_cumulative():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    samples = parse_metrics("\n".join(h.render("t", "help")))
    assert (samples['t_bucket{le="0.1"}'], samples['t_bucket{le="1.0"}'], samples['t_bucket{le="+Inf"}']) == (1, 2, 3)


async def _items(*values):
    for v in values:
        yield v


async def test_merge_tags_items_and_collect_all_folds_outputs():
    merged = [item async for item in merge([_items(1, 2), _items(3)])]
    assert sorted(merged) == [(0, 1), (0, 2), (1, 3)]
    engine = AsyncEngine(FakeBackend())
    streams = [engine.generate(p, max_new_tokens=3) for p in ("a", "b")]
    responses = await collect_all(streams)
    assert [len(r.token_ids) for r in responses] == [3, 3]
    await engine.close()


async def test_dead_engine_is_503_and_unexpected_errors_are_generic_500s():
    backend = FakeBackend()
    engine = AsyncEngine(backend)
    app = build_app(engine)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        assert (await http.get("/health")).status_code == 200
        engine.tokenize = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("secret detail"))
        response = await http.post("/tokenize", json={"prompt": "x"})
        assert response.status_code == 500 and "secret" not in response.text
        assert response.json()["error"]["type"] == "internal_error"
        await engine.close()
        assert (await http.get("/health")).status_code == 503
        assert (await http.post("/v1/completions", json={"prompt": "x"})).status_code == 503


async def test_an_internal_core_error_is_logged_with_its_route(caplog):
    """A CoreError of the internal kind (a BackendError) answers the generic 500, whose body points at the
    server log; the log then holds a line naming the route and the error (it held nothing)."""
    from core.errors import BackendError

    engine = AsyncEngine(FakeBackend())
    transport = httpx.ASGITransport(app=build_app(engine), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        engine.tokenize = lambda *a, **k: (_ for _ in ()).throw(BackendError("the KV cache was gone"))
        with caplog.at_level("ERROR", logger="core.server.errors"):
            response = await http.post("/tokenize", json={"prompt": "x"})
        assert response.status_code == 500
        assert any("/tokenize" in r.getMessage() and "the KV cache was gone" in r.getMessage()
                   for r in caplog.records)
    await engine.close()


async def test_a_real_backend_whose_engine_loop_died_is_unhealthy(tiny_llama_checkpoint, monkeypatch):
    from core.config import EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_llama_checkpoint), backend="pytorch",
                                                  kv_cache_memory_gib=0.01))
    transport = httpx.ASGITransport(app=build_app(engine), raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            assert (await http.get("/health")).json() == {"status": "ok"}
            ended = threading.Thread(target=lambda: None)
            ended.start()
            ended.join()
            monkeypatch.setattr(engine.backend.loop, "_thread", ended)  # as if the loop thread had died
            response = await http.get("/health")
            assert response.status_code == 503 and response.json() == {"status": "unhealthy"}
            monkeypatch.undo()
            assert (await http.get("/health")).status_code == 200
    finally:
        await engine.close()


async def test_a_request_closed_before_its_first_output_is_counted():
    """A client that leaves before the first token (while its request was being prepared) still counts."""
    from core.server.metrics import Metrics

    engine = AsyncEngine(FakeBackend())
    metrics = Metrics()
    tracked = metrics.track(engine.generate("hi", max_new_tokens=3))
    await tracked.aclose()
    await tracked.aclose()  # once only
    assert metrics.requests == {"abort": 1} and len(engine.sessions) == 0
    whole = metrics.track(engine.generate("hi", max_new_tokens=3))
    assert len([o async for o in whole]) == 3
    await whole.aclose()
    assert metrics.requests == {"abort": 1, "length": 1}
    await engine.close()


def _decode(ids) -> str:
    return "".join(chr(i) for i in ids)


PROMPT_ENTRIES = [None, TokenLogprob(66, -1.5, ((90, -0.5), (66, -1.5)), rank=2),
                  TokenLogprob(67, -0.2, ((67, -0.2), (90, -2.0)), rank=1)]


def test_echo_and_prompt_logprobs_config():
    config = tr.completion_generation_config(CompletionRequest(prompt="x", echo=True, max_tokens=0, logprobs=2))
    assert (config.max_new_tokens, config.top_logprobs, config.prompt_logprobs) == (1, 2, 2)
    both = tr.completion_generation_config(CompletionRequest(prompt="x", echo=True, logprobs=1, prompt_logprobs=3))
    assert both.prompt_logprobs == 3
    assert tr.completion_generation_config(CompletionRequest(prompt="x", echo=True)).prompt_logprobs is None
    assert tr.chat_generation_config(chat(prompt_logprobs=0)).prompt_logprobs == 0
    with pytest.raises(InvalidRequestError, match="allowed with echo"):
        tr.completion_generation_config(CompletionRequest(prompt="x", max_tokens=0))


def test_echoed_prompt_then_generated_legacy_logprobs():
    echo = tr.Echo("ABC", (65, 66, 67), logprobs=1)
    generated = [TokenLogprob(68, -0.7, ((68, -0.7),))]
    legacy = echo.choice_logprobs(PROMPT_ENTRIES, generated, _decode)
    assert legacy == {"tokens": ["A", "B", "C", "D"], "token_logprobs": [None, -1.5, -0.2, -0.7],
                      "top_logprobs": [None, {"Z": -0.5}, {"C": -0.2}, {"D": -0.7}], "text_offset": [0, 1, 2, 3]}
    assert echo.choice_text("D") == "ABCD" and echo.choice_text("E", first=False) == "E"
    later = echo.choice_logprobs(None, generated, _decode, offset=4, first=False)
    assert later["text_offset"] == [4] and later["tokens"] == ["D"]
    only = tr.Echo("ABC", (65, 66, 67), logprobs=0, prompt_only=True)
    assert only.choice_text("D") == "ABC"
    assert only.choice_logprobs(PROMPT_ENTRIES, generated, _decode)["top_logprobs"] == [None, {}, {}]
    assert tr.Echo().choice_logprobs(None, generated, _decode) == tr.completion_logprobs(generated, _decode)


def test_vllm_prompt_logprobs_shape():
    shaped = tr.vllm_prompt_logprobs(PROMPT_ENTRIES, _decode)
    assert shaped[0] is None
    assert shaped[1] == {"66": {"logprob": -1.5, "rank": 2, "decoded_token": "B"},
                         "90": {"logprob": -0.5, "rank": 1, "decoded_token": "Z"}}
    assert list(shaped[2]) == ["67", "90"] and tr.vllm_prompt_logprobs(None, _decode) is None


def test_core_serve_parses_http_with_h11_even_where_httptools_is_installed():
    """uvicorn's "auto" would take httptools where it is installed (ray[serve] brings it into the test run's
    environment); `core serve` always takes h11, what a plain install has."""
    import argparse

    from uvicorn.protocols.http.h11_impl import H11Protocol

    from core.server.run import uvicorn_config

    async def app(scope, receive, send):  # pragma: no cover - never called
        raise AssertionError("not served")

    config = uvicorn_config(app, argparse.Namespace(host="127.0.0.1", port=0))
    config.load()
    assert config.http_protocol_class is H11Protocol
