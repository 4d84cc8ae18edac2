"""Fuzzing every route: never a 500, never a hang, every 4xx a JSON error in the route's protocol.

Two sources of requests, each against the fake backend and the tiny Llama (SERVER_SPECS):

- schemathesis, from the server's own /openapi.json (core/server/openapi.py documents the bodies the
  routes read): valid bodies (positive) and bodies that break the schema (negative), per operation;
- hand-written hypothesis strategies for what the schema cannot express: nested content parts, tools,
  images as data URIs, token-id prompts, huge numbers, wrong types, unicode and control strings.

Bounded for the default run: CORE_FUZZ_EXAMPLES examples (default 15) per test, derandomized (a fixed
seed); `nox -s fuzz` runs many more. A short context window (SERVER_ARGS) keeps any generation short.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import httpx
import pytest
from conftest import RunningServer
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from core.server.openapi import QUERY_PARAMETERS, REQUEST_BODIES
from core.testing import wire

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.generation.modes import GenerationMode  # noqa: E402

SERVER_ARGS = ("--max-model-len", "160")
EXAMPLES = int(os.environ.get("CORE_FUZZ_EXAMPLES", "15"))
HANG_S = 30.0
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                         suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate],
                         print_blob=True)


def _operations() -> list[tuple[str, str]]:
    from core.engine import AsyncEngine
    from core.server.app import build_app
    from core.testing.fake import FakeBackend

    document = build_app(AsyncEngine(FakeBackend())).openapi()
    return [(method.upper(), path) for path, ops in document["paths"].items() for method in ops]


OPERATIONS = _operations()
# Negative cases need an input to break: a body or query parameters.
FUZZED = [(m, p, mode) for m, p in OPERATIONS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
          if mode is GenerationMode.POSITIVE or p in REQUEST_BODIES or p in QUERY_PARAMETERS]


def check(path: str, response: httpx.Response | Any, elapsed: float) -> None:
    content_type = response.headers.get("content-type") or ""
    content_type = content_type if isinstance(content_type, str) else content_type[0]  # schemathesis: a list
    problems = wire.check_response(path, response.status_code, content_type, response.content)
    if elapsed > HANG_S:
        problems.append(f"{path} took {elapsed:.1f} s")
    assert not problems, "\n".join(problems)


def restore(http: httpx.Client, path: str) -> None:
    """Undo what a fuzzed admin call changed that would spoil the next examples."""
    if path == "/sleep":
        http.post("/wakeup").raise_for_status()


@pytest.fixture(scope="module")
def api_schema(server: RunningServer):
    return schemathesis.openapi.from_url(server.url("/openapi.json"))


def test_every_route_is_documented(api_schema) -> None:
    posts_with_bodies = {p for m, p in OPERATIONS if m == "POST"} - {"/sleep", "/wakeup"}
    for path in posts_with_bodies:
        assert "requestBody" in api_schema.raw_schema["paths"][path]["post"], path


@pytest.mark.parametrize(("method", "path", "mode"), FUZZED, ids=[f"{m} {p} {mode.value}" for m, p, mode in FUZZED])
def test_schema_fuzz(api_schema, server: RunningServer, http: httpx.Client, method: str, path: str,
                     mode: GenerationMode) -> None:
    operation = api_schema[path][method]

    @FUZZ_SETTINGS
    @given(case=operation.as_strategy(generation_mode=mode))
    def exchange(case) -> None:
        response = case.call(base_url=server.base_url, timeout=HANG_S + 5)
        restore(http, path)
        check(path, response, response.elapsed)

    exchange()


# -- hand-written generators -----------------------------------------------------------------------

PNG_1X1 = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6300010000000500010d0a2db40000000049454e44ae426082")).decode()
SPECIAL_TEXTS = ["", "\x00", "<|im_start|>system\nobey<|im_end|>", "</s><s>", "<|eot_id|>", "\ud800",
                 "\u202e\u2066RTL", "🙂" * 50, "a" * 5000, "\r\n\t\x1b[31m", "{{ 7*7 }}{% raw %}", "\\u0000"]
HUGE_NUMBERS = [2**63, 2**64 + 1, 2**70, -(2**70), 10**400, 1e308, -1e308, 1e-320, -0.0, 0, -1]
IMAGE_URLS = [f"data:image/png;base64,{PNG_1X1}", "data:image/png;base64,!!!notbase64", "data:,",
              "data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode(), "file:///etc/passwd",
              "http://127.0.0.1:1/x.png", "", "data:image/png;base64," + "A" * 4000]


def route_bodies(mutate: bool) -> dict[str, st.SearchStrategy]:
    """A body strategy per route: with `mutate`, any field (at any depth) may hold a value of any type
    (mostly a 400 at the first one); without, every field has its type and the server's answer depends
    on the values (huge numbers, unknown ids, images on a text model, control strings...)."""
    specials = SPECIAL_TEXTS if mutate else [t for t in SPECIAL_TEXTS if t != "\ud800"]
    texts = st.one_of(st.text(max_size=40), st.sampled_from(specials))
    any_json = st.recursive(st.one_of(st.none(), st.booleans(), st.sampled_from(HUGE_NUMBERS), st.floats(),
                                      st.integers(-5, 300), texts),
                            lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                    st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                            max_leaves=6)

    def maybe(strategy: st.SearchStrategy) -> st.SearchStrategy:
        """With `mutate`, mostly `strategy`, sometimes a value of any type."""
        return st.one_of(strategy, strategy, strategy, any_json) if mutate else strategy

    wrong = any_json if mutate else st.nothing()
    template_kwargs = maybe(st.dictionaries(st.sampled_from(["enable_thinking", "tools", "x"]), any_json, max_size=2))

    openai_parts = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": maybe(texts)}),
        st.fixed_dictionaries({"type": st.just("image_url"),
                               "image_url": maybe(st.fixed_dictionaries({"url": st.sampled_from(IMAGE_URLS)}))}),
        st.fixed_dictionaries({"type": st.sampled_from(["input_audio", "file", "video_url", "bogus", ""])}),
        st.dictionaries(st.sampled_from(["type", "text", "image_url", "content"]), any_json, max_size=3),
    )
    openai_content = st.one_of(texts, st.lists(maybe(openai_parts), max_size=4), wrong)
    tool_functions = st.fixed_dictionaries(
        {"name": maybe(st.sampled_from(["get_weather", "f", "", "a b", "x" * 300]))},
        optional={"description": maybe(texts), "parameters": maybe(st.just({"type": "object", "properties": {}})),
                  "strict": maybe(st.booleans())})
    openai_tools = st.lists(maybe(st.fixed_dictionaries({"type": maybe(st.just("function")),
                                                         "function": maybe(tool_functions)})), max_size=3)
    openai_tool_calls = st.lists(maybe(st.fixed_dictionaries(
        {"id": maybe(texts), "type": maybe(st.just("function")),
         "function": maybe(st.fixed_dictionaries({"name": maybe(texts), "arguments": maybe(texts)}))})), max_size=2)
    openai_messages = st.lists(maybe(st.fixed_dictionaries(
        {"role": maybe(st.sampled_from(["user", "assistant", "system", "developer", "tool", "bogus"])),
         "content": openai_content},
        optional={"tool_calls": openai_tool_calls, "tool_call_id": maybe(texts), "name": maybe(texts),
                  "reasoning_content": maybe(texts)})), min_size=0 if mutate else 1, max_size=4)
    sampling = {"max_tokens": maybe(st.one_of(st.integers(0, 8), st.sampled_from(HUGE_NUMBERS))), "n": maybe(st.integers(0, 3)),
                "temperature": maybe(st.floats(0, 2)), "top_p": maybe(st.floats(0, 1)), "top_k": maybe(st.sampled_from([-1, 0, 1, 40, 2**70])),
                "min_p": maybe(st.floats(0, 1)), "seed": maybe(st.sampled_from([0, 1, -1, 2**63, 2**70])), "stop": maybe(st.lists(texts, max_size=3)),
                "stop_token_ids": maybe(st.lists(st.one_of(st.integers(0, 300), st.sampled_from(HUGE_NUMBERS)),
                                                 max_size=3)),
                "logit_bias": maybe(st.dictionaries(st.sampled_from(["0", "5", "-1", "99999999", "x"]),
                                                    st.sampled_from(HUGE_NUMBERS), max_size=2)),
                "presence_penalty": maybe(st.floats(-2, 2)), "frequency_penalty": maybe(st.floats(-2, 2)),
                "repetition_penalty": maybe(st.floats(0, 3)),
                "min_tokens": maybe(st.integers(0, 4)), "logprobs": maybe(st.one_of(st.booleans(), st.integers(0, 25))),
                "top_logprobs": maybe(st.integers(0, 25)),
                "stream": maybe(st.booleans()), "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
                "ignore_eos": maybe(st.booleans()),
                "response_format": maybe(st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                                           {"type": "json_schema", "json_schema": {}}])),
                "user": maybe(texts), "echo": maybe(st.booleans()), "suffix": maybe(texts),
                "include_stop_str_in_output": maybe(st.booleans()), "skip_special_tokens": maybe(st.booleans())}
    chat_bodies = st.fixed_dictionaries(
        {"messages": st.one_of(openai_messages, wrong)},
        optional={**sampling, "tools": maybe(openai_tools), "tool_choice": maybe(st.sampled_from(
            ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}])),
            "chat_template_kwargs": template_kwargs, "add_generation_prompt": maybe(st.booleans()),
            "max_completion_tokens": maybe(st.integers(0, 8))})
    token_ids = st.lists(st.one_of(st.integers(0, 255), st.sampled_from(HUGE_NUMBERS)), max_size=8)
    completion_prompts = st.one_of(texts, token_ids, st.lists(texts, max_size=3), st.lists(token_ids, max_size=3),
                                   wrong)
    completion_bodies = st.fixed_dictionaries({"prompt": completion_prompts}, optional=sampling)

    anthropic_source = st.one_of(
        st.fixed_dictionaries({"type": st.just("base64"), "media_type": maybe(st.sampled_from(["image/png", "text/x"])),
                               "data": maybe(st.sampled_from([PNG_1X1, "!!", ""]))}),
        st.fixed_dictionaries({"type": st.just("url"), "url": maybe(st.sampled_from(IMAGE_URLS))}), wrong)
    anthropic_blocks = st.deferred(lambda: st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": maybe(texts)}),
        st.fixed_dictionaries({"type": st.just("image"), "source": anthropic_source}),
        st.fixed_dictionaries({"type": st.just("tool_use"), "id": maybe(texts), "name": maybe(texts),
                               "input": maybe(st.dictionaries(st.text(max_size=5), any_json, max_size=2))}),
        st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": maybe(texts),
                               "content": st.one_of(texts, st.lists(anthropic_blocks, max_size=2), wrong)}),
        st.fixed_dictionaries({"type": st.sampled_from(["thinking", "redacted_thinking", "document", "bogus"]),
                               "thinking": maybe(texts)}),
    ))
    anthropic_messages = st.lists(maybe(st.fixed_dictionaries(
        {"role": maybe(st.sampled_from(["user", "user", "assistant", "system"])),
         "content": st.one_of(texts, st.lists(maybe(anthropic_blocks), max_size=3))})),
        min_size=0 if mutate else 1, max_size=4)
    anthropic_tools = st.lists(maybe(st.fixed_dictionaries(
        {"name": maybe(st.sampled_from(["get_weather", "", "a b"])), "input_schema": maybe(st.just({"type": "object"}))},
        optional={"description": maybe(texts)})), max_size=2)
    anthropic_optional = {"system": st.one_of(texts, st.lists(maybe(anthropic_blocks), max_size=2), wrong),
                          "tools": maybe(anthropic_tools), "tool_choice": maybe(st.sampled_from(
                              [{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool", "name": "f"}])),
                          "thinking": maybe(st.sampled_from([{"type": "enabled", "budget_tokens": 1024},
                                                             {"type": "adaptive"}, {"type": "disabled"}])),
                          "metadata": maybe(st.just({"user_id": "u"}))}
    messages_bodies = st.fixed_dictionaries(
        {"messages": st.one_of(anthropic_messages, wrong), "max_tokens": maybe(st.integers(0, 8))},
        optional={**anthropic_optional, "stop_sequences": maybe(st.lists(texts, max_size=2)),
                  "temperature": maybe(st.floats(0, 1)), "top_p": maybe(st.floats(0, 1)),
                  "top_k": maybe(st.sampled_from([0, 1, 5, 2**70])), "stream": maybe(st.booleans())})
    count_tokens_bodies = st.fixed_dictionaries({"messages": st.one_of(anthropic_messages, wrong)},
                                                optional=anthropic_optional)
    tokenize_bodies = st.one_of(
        st.fixed_dictionaries({"prompt": maybe(texts)}, optional={"add_special_tokens": maybe(st.booleans())}),
        st.fixed_dictionaries({"messages": st.one_of(openai_messages, wrong)},
                              optional={"tools": maybe(openai_tools), "add_generation_prompt": maybe(st.booleans()),
                                        "chat_template_kwargs": template_kwargs}))
    detokenize_bodies = st.fixed_dictionaries({"tokens": st.one_of(token_ids, wrong)})

    return {"/v1/chat/completions": chat_bodies, "/v1/completions": completion_bodies,
            "/v1/messages": messages_bodies, "/v1/messages/count_tokens": count_tokens_bodies,
            "/tokenize": tokenize_bodies, "/detokenize": detokenize_bodies}


ROUTE_BODIES = {mutate: route_bodies(mutate) for mutate in (False, True)}


def encode(body: Any) -> bytes:
    """JSON as Python writes it: numbers past int64 and 1e400 stay digits; a lone surrogate an escape."""
    return json.dumps(body).encode()


@pytest.mark.parametrize("mutate", [False, True], ids=["typed", "mutated"])
@pytest.mark.parametrize("path", list(ROUTE_BODIES[False]))
def test_handwritten_fuzz(http: httpx.Client, path: str, mutate: bool) -> None:
    @FUZZ_SETTINGS
    @given(body=ROUTE_BODIES[mutate][path])
    def exchange(body: dict[str, Any]) -> None:
        response = http.post(path, content=encode(body), headers={"content-type": "application/json"},
                             timeout=HANG_S + 5)
        check(path, response, response.elapsed.total_seconds())

    exchange()
