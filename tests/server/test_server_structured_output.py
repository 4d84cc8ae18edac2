"""Structured output on the default model (SmolLM2 from the GGUF) through `core serve`: JSON schemas
validated by jsonschema, json_object, regex and choice, forced tool calls through the official openai and
anthropic clients, n > 1, and the 400s that name their field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import openai
import pytest
from conftest import RunningServer, ServerSpec, serve_default_model
from structured_schemas import SCHEMAS, prompt

jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")
pytestmark = pytest.mark.slow

# The default model, with the hermes tool-call parser (SmolLM2's template names none): forced tool calls
# are generated as <tool_call>{...}</tool_call>.
SMOLLM2 = ServerSpec("smollm2-structured", backend=None, args=("--tool-call-parser", "hermes"))
TIMEOUT_S = 300.0
MODEL = "SmolLM2-135M-Instruct.Q4_1"  # the name `core serve` reports for the default model
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string", "maxLength": 30},
                                                                          "unit": {"enum": ["C", "F"]}},
                                                           "required": ["city", "unit"],
                                                           "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                         "parameters": {"type": "object", "properties": {
                                             "zone": {"type": "string", "maxLength": 30}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def smollm2() -> Iterator[RunningServer]:
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar")
    yield from serve_default_model(SMOLLM2)


@pytest.fixture
def client(smollm2: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=smollm2.url("/v1"), api_key="unused", max_retries=0, timeout=TIMEOUT_S) as c:
        yield c


def _schema_request(client: openai.OpenAI, description: str, schema: dict, **sampling) -> tuple[str, str]:
    out = client.chat.completions.create(
        model=MODEL, messages=prompt(description), max_tokens=150,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
        **sampling)
    return out.choices[0].message.content, out.choices[0].finish_reason


def _check(schema: dict, text: str, finish: str) -> bool:
    """A completion that stopped parses and validates; one cut by max_tokens is not checked."""
    if finish != "stop":
        assert finish == "length", finish
        return False
    jsonschema.validate(json.loads(text), schema)
    return True


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.95, "seed": 7}],
                         ids=["greedy", "sampled"])
def test_schemas_validate_under_16_concurrent_mixed_requests(client, sampling):
    """Every schema, 16 at a time, with unconstrained requests in the same batches."""
    plain = [lambda: client.chat.completions.create(model=MODEL, messages=prompt("a story"), max_tokens=40)] * 4
    with ThreadPoolExecutor(16) as pool:
        others = [pool.submit(f) for f in plain]
        results = list(pool.map(lambda item: _schema_request(client, *item, **sampling), SCHEMAS))
        assert all(o.result().choices[0].message.content for o in others)
    checked = [_check(schema, text, finish) for (_, schema), (text, finish) in zip(SCHEMAS, results, strict=True)]
    assert len(SCHEMAS) >= 20 and sum(checked) >= len(SCHEMAS) * 3 // 4, results


def test_json_object_parses(client):
    out = client.chat.completions.create(model=MODEL, messages=prompt("a cat's name and age"), max_tokens=120,
                                         temperature=0.0, response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_parse_returns_a_pydantic_object(client):
    """The acceptance check: the openai client's parse() with a pydantic model. Every field is bounded, so
    that a small model's greedy digits (11111111... under torch's int4 kernel, seen) cannot run to
    max_tokens."""

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=40)
        country: str = pydantic.Field(max_length=40)
        population: int = pydantic.Field(ge=0, le=100_000_000)

    out = client.chat.completions.parse(model=MODEL, messages=prompt("the largest city of France"),
                                        response_format=City, max_tokens=200, temperature=0.0)
    assert isinstance(out.choices[0].message.parsed, City), out


def test_regex_and_choice(client, smollm2: RunningServer):
    out = client.chat.completions.create(model=MODEL, messages=prompt("a phone number"), max_tokens=30,
                                         temperature=0.0, extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", out.choices[0].message.content)
    out = client.chat.completions.create(model=MODEL, messages=prompt("is the sky blue"), max_tokens=10,
                                         extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].message.content in ("yes", "no")
    body = {"prompt": "The colour of grass is", "max_tokens": 10, "guided_regex": "(green|blue)"}
    text = httpx.post(smollm2.url("/v1/completions"), json=body, timeout=TIMEOUT_S).json()["choices"][0]["text"]
    assert text in ("green", "blue")


def test_grammar_and_a_streamed_schema(client):
    out = client.chat.completions.create(model=MODEL, messages=prompt("count"), max_tokens=20, temperature=0.0,
                                         extra_body={"guided_grammar": 'root ::= "1, 2, " [0-9]'})
    assert re.fullmatch(r"1, 2, \d", out.choices[0].message.content)
    _, schema = SCHEMAS[0]
    stream = client.chat.completions.create(
        model=MODEL, messages=prompt("a person"), max_tokens=120, temperature=0.0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert _check(schema, text, finish)


def test_n3_gives_three_valid_objects(client):
    description, schema = SCHEMAS[0]
    out = client.chat.completions.create(model=MODEL, messages=prompt(description), max_tokens=120, n=3,
                                         temperature=1.0, seed=3, logprobs=True,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "p", "schema": schema}})
    assert len(out.choices) == 3
    for choice in out.choices:
        assert _check(schema, choice.message.content, choice.finish_reason)
        assert choice.logprobs.content  # the model's own distribution, reported as usual


def test_a_constraint_cut_by_max_tokens_ends_with_length(client):
    _, schema = SCHEMAS[7]
    out = client.chat.completions.create(model=MODEL, messages=prompt("a book"), max_tokens=3, temperature=0.0,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "b", "schema": schema}})
    assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_validate(client, tool_choice, stream):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    args = {"model": MODEL, "messages": messages, "tools": [WEATHER, TIME], "tool_choice": tool_choice,
            "max_tokens": 120, "temperature": 0.0}
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(**args, stream=True):
            if not chunk.choices:
                continue
            finish = chunk.choices[0].finish_reason or finish
            for call in chunk.choices[0].delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
                entry["name"] = call.function.name or entry["name"]
                entry["arguments"] += call.function.arguments or ""
        found = [(c["name"], c["arguments"]) for c in calls.values()]
    else:
        out = client.chat.completions.create(**args)
        finish = out.choices[0].finish_reason
        found = [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls or ()]
    # OpenAI ends a call it was told to make by name "stop" (vLLM too), any other call "tool_calls"
    assert finish == ("stop" if isinstance(tool_choice, dict) else "tool_calls") and len(found) == 1, (finish, found)
    name, arguments = found[0]
    if isinstance(tool_choice, dict):
        assert name == "get_time"
    tool = {"get_weather": WEATHER, "get_time": TIME}[name]
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


def test_anthropic_output_format_through_the_clients_parse(smollm2: RunningServer):
    """The anthropic client's messages.parse(output_format=...) sends output_config.format: it was ignored
    (free text, which parse() could not read). The client drops bounds (maxLength, maximum) from the schema
    it sends, so the fields are ones a small model's greedy output ends."""
    anthropic = pytest.importorskip("anthropic")

    class City(pydantic.BaseModel):
        country: Literal["France", "Italy", "Spain"]
        is_capital: bool

    with anthropic.Anthropic(base_url=smollm2.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT_S) as c:
        out = c.messages.parse(model=MODEL, max_tokens=200, output_format=City, extra_body={"temperature": 0.0},
                               messages=prompt("the largest city of France"))
        assert isinstance(out.parsed_output, City), out
        with pytest.raises(anthropic.BadRequestError, match="output_config.format"):
            c.messages.create(model=MODEL, max_tokens=5, messages=prompt("a city"),
                              output_config={"format": {"type": "json_schema"}})


def test_anthropic_tool_choice_any_gives_a_tool_use_block(smollm2: RunningServer):
    anthropic = pytest.importorskip("anthropic")
    function = WEATHER["function"]
    with anthropic.Anthropic(base_url=smollm2.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT_S) as c:
        out = c.messages.create(model=MODEL, max_tokens=120, tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "Weather in Rome?"}],
                                tools=[{"name": function["name"], "description": function["description"],
                                        "input_schema": function["parameters"]}],
                                extra_body={"temperature": 0.0})
    blocks = [b for b in out.content if b.type == "tool_use"]
    assert out.stop_reason == "tool_use" and len(blocks) == 1, out
    assert blocks[0].name == "get_weather"
    jsonschema.validate(blocks[0].input, function["parameters"])


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_bad_constraints_are_400s_naming_the_field(smollm2: RunningServer, body, param):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body}
    response = httpx.post(smollm2.url("/v1/chat/completions"), json=request, timeout=TIMEOUT_S)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize(("schema", "path"), [
    ({"type": "object", "properties": {"a": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}}},
     "properties.a.patternProperties"),
    ({"$defs": {"n": {"type": "integer", "not": {"const": 3}}}, "$ref": "#/$defs/n"}, "$defs.n.not"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
])
def test_an_unsupported_schema_keyword_is_a_400_naming_the_field_and_path(client, schema, path):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=prompt("anything"), max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == "response_format.json_schema.schema", error
    assert error["message"] == (f"response_format.json_schema.schema: {path} is not supported by the "
                                "structured-output engine"), error


def _cached_tokens(usage) -> int:
    details = usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


def test_prefix_cached_constrained_requests_give_identical_valid_output(client):
    """The second of two identical greedy requests is served from the first's cached prefix blocks."""
    description, schema = SCHEMAS[1]
    long_prompt = prompt(description + ". " + "Use short values and no extra keys. " * 8)
    outs = [client.chat.completions.create(
        model=MODEL, messages=long_prompt, max_tokens=150, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}) for _ in range(2)]
    first, second = (o.choices[0] for o in outs)
    assert _cached_tokens(outs[1].usage) > 0, outs[1].usage
    assert second.message.content == first.message.content and second.finish_reason == first.finish_reason
    assert _check(schema, second.message.content, second.finish_reason)


@pytest.mark.parametrize("level", [1, 2])
def test_a_constrained_request_validates_after_sleep_and_wakeup(client, smollm2: RunningServer, level):
    description, schema = SCHEMAS[2]
    before, _ = _schema_request(client, description, schema, temperature=0.0)
    with httpx.Client(base_url=smollm2.base_url, timeout=TIMEOUT_S) as http:
        assert http.post("/sleep", params={"level": str(level)}).json()["is_sleeping"] is True
        assert http.post("/wakeup").json()["is_sleeping"] is False
    text, finish = _schema_request(client, description, schema, temperature=0.0)
    assert _check(schema, text, finish) and text == before


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_time"}],
                         ids=["required", "named"])
def test_forced_tool_choice_through_the_responses_api(client, tool_choice, stream):
    """The Responses route plans with the chat route's chat_plan and the hermes call format."""
    tools = [{"type": "function", **tool["function"]} for tool in (WEATHER, TIME)]
    args = {"model": MODEL, "input": "What is the weather in Paris?", "tools": tools, "tool_choice": tool_choice,
            "max_output_tokens": 120, "temperature": 0.0}
    if stream:
        events = list(client.responses.create(**args, stream=True))
        assert events[-1].type == "response.completed", events[-1]
        response = events[-1].response
    else:
        response = client.responses.create(**args)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1, response.output
    if isinstance(tool_choice, dict):
        assert calls[0].name == "get_time"
    tool = {"get_weather": WEATHER, "get_time": TIME}[calls[0].name]
    jsonschema.validate(json.loads(calls[0].arguments), tool["function"]["parameters"])


# The default model with no tool-call parser at all (SmolLM2's template names none): a forced call is
# generated as the bare JSON object {"name": ..., "arguments": {...}} and still comes back as a call.
PLAIN = ServerSpec("smollm2-no-tool-parser", backend=None)


@pytest.fixture(scope="module")
def plain_server() -> Iterator[RunningServer]:
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar")
    yield from serve_default_model(PLAIN)


@pytest.mark.parametrize(("tool_choice", "stream"), [({"type": "function", "function": {"name": "get_time"}}, False),
                                                     ("required", True)], ids=["named", "required-streamed"])
def test_forced_tool_calls_without_a_tool_call_parser(plain_server: RunningServer, tool_choice, stream):
    with openai.OpenAI(base_url=plain_server.url("/v1"), api_key="unused", max_retries=0, timeout=TIMEOUT_S) as c:
        args = {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                "tools": [WEATHER, TIME], "tool_choice": tool_choice, "max_tokens": 120, "temperature": 0.0}
        if stream:
            calls, finish = {}, None
            for chunk in c.chat.completions.create(**args, stream=True):
                for call in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
                    entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
                    entry["name"] = call.function.name or entry["name"]
                    entry["arguments"] += call.function.arguments or ""
                finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
            found = [(entry["name"], entry["arguments"]) for entry in calls.values()]
        else:
            out = c.chat.completions.create(**args)
            finish = out.choices[0].finish_reason
            assert out.choices[0].message.content is None
            found = [(call.function.name, call.function.arguments) for call in out.choices[0].message.tool_calls]
        # tool_choice auto on the same server: no parser reads anything, the text is content
        auto = c.chat.completions.create(**{**args, "tool_choice": "auto", "max_tokens": 20})
    # OpenAI ends a call it was told to make by name "stop" (vLLM too), any other call "tool_calls"
    assert finish == ("stop" if isinstance(tool_choice, dict) else "tool_calls") and len(found) == 1, (finish, found)
    name, arguments = found[0]
    assert name == "get_time" or not isinstance(tool_choice, dict)
    jsonschema.validate(json.loads(arguments), {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"])
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content


def test_anthropic_forced_tool_use_without_a_tool_call_parser(plain_server: RunningServer):
    anthropic = pytest.importorskip("anthropic")
    function = WEATHER["function"]
    with anthropic.Anthropic(base_url=plain_server.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT_S) as c:
        out = c.messages.create(model=MODEL, max_tokens=120, tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Rome?"}],
                                tools=[{"name": function["name"], "input_schema": function["parameters"]}],
                                extra_body={"temperature": 0.0})
    blocks = [b for b in out.content if b.type == "tool_use"]
    assert out.stop_reason == "tool_use" and len(blocks) == 1 and blocks[0].name == "get_weather", out
    jsonschema.validate(blocks[0].input, function["parameters"])


def test_tool_round_trips_on_a_template_without_tool_support(plain_server: RunningServer):
    """SmolLM2's template reads every message's content; a turn of tool calls only (OpenAI content None,
    Anthropic tool_use blocks) renders with empty content, as vLLM does, where it was a 400."""
    anthropic = pytest.importorskip("anthropic")
    with openai.OpenAI(base_url=plain_server.url("/v1"), api_key="unused", max_retries=0, timeout=TIMEOUT_S) as c:
        out = c.chat.completions.create(model=MODEL, max_tokens=8, tools=[WEATHER], messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}])
    assert out.choices[0].message.content
    function = WEATHER["function"]
    with anthropic.Anthropic(base_url=plain_server.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT_S) as c:
        message = c.messages.create(model=MODEL, max_tokens=8, tools=[
            {"name": function["name"], "input_schema": function["parameters"]}], messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                               "input": {"city": "Paris", "unit": "C"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "21 C"}]}])
    assert message.content and message.content[0].type == "text"
