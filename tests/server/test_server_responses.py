"""The Responses API through the official openai client over a socket: `responses.create` (whole and
streamed), `responses.stream`, `output_text`, instructions, limits, usage and the stateless 400s, on every
server in SERVER_SPECS; tools and reasoning on the scripted backend (as in test_server_tools.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import ServerSpec, run_server
from server_helpers import abort_while_running, assert_openai_error
from test_server_tools import ENV, QWEN3_AUTO, QWEN25_TEMPLATE, TOOLS, ask

from core.testing.parse import parse_sse

GREEDY = {"temperature": 0.0}
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
PLAIN_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_string_input_is_the_chat_turn(client: openai.OpenAI, model: str):
    response = client.responses.create(model=model, input="Say hi.", max_output_tokens=5, **GREEDY)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=5, **GREEDY)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == model
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")


def test_instructions_and_message_items_are_the_chat_messages(client: openai.OpenAI, model: str):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
             {"role": "developer", "content": "Stay short."}, {"role": "user", "content": "Bye"}]
    response = client.responses.create(model=model, input=items, instructions="Be brief.", max_output_tokens=4,
                                       **GREEDY)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi."}, {"role": "system", "content": "Stay short."},
                {"role": "user", "content": "Bye"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=4, **GREEDY)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.instructions == "Be brief."


def test_the_token_limit_makes_it_incomplete(client: openai.OpenAI, model: str):
    response = client.responses.create(model=model, input="Talk.", max_output_tokens=2, extra_body={"ignore_eos": True},
                                       **GREEDY)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Talk."}],
                                          max_tokens=2, **GREEDY)
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert response.usage.output_tokens == 2 and response.output[-1].status == "incomplete"


def test_stream_events_in_the_documented_order(client: openai.OpenAI, model: str):
    whole = client.responses.create(model=model, input="Say hi.", max_output_tokens=6, **GREEDY)
    events = list(client.responses.create(model=model, input="Say hi.", max_output_tokens=6, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:5] == PLAIN_ORDER
    deltas = kinds.index("response.output_text.done")
    assert set(kinds[4:deltas]) == {"response.output_text.delta"}
    assert kinds[deltas:] == [*CLOSING, f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_the_clients_stream_helper(client: openai.OpenAI, model: str):
    whole = client.responses.create(model=model, input="Say hi.", max_output_tokens=6, **GREEDY)
    with client.responses.stream(model=model, input="Say hi.", max_output_tokens=6, **GREEDY) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response() if whole.status == "completed" else None
    assert "".join(texts) == whole.output_text
    if final is not None:
        assert final.output_text == whole.output_text and final.status == "completed"


@pytest.mark.parametrize(("field", "value"), [("previous_response_id", "resp_123"), ("store", True),
                                              ("conversation", "conv_1"),
                                              ("prompt", {"id": "pmpt_1", "variables": {"city": "Paris"}})])
def test_state_is_a_400(http: httpx.Client, field: str, value: Any):
    error = assert_openai_error(http.post("/v1/responses", json={"input": "hi", field: value}), 400, field)
    assert "keeps no state" in error["message"]


def test_previous_response_id_through_the_client(client: openai.OpenAI, model: str):
    with pytest.raises(openai.BadRequestError, match="keeps no state"):
        client.responses.create(model=model, input="hi", previous_response_id="resp_1")


def test_store_false_is_accepted(client: openai.OpenAI, model: str):
    response = client.responses.create(model=model, input="hi", store=False, max_output_tokens=2)
    assert response.store is False


def test_json_schema_format_needs_structured_output(http: httpx.Client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                     "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    body = {"input": "hi", "max_output_tokens": 8,
            "text": {"format": {"type": "json_schema", "name": "a", "schema": schema}}}
    response = http.post("/v1/responses", json=body)
    if chat.status_code == 200:  # structured output has landed: text.format is its response_format
        assert response.status_code == 200, response.text
    else:
        assert "structured output" in assert_openai_error(response, 400, "text.format")["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "get weather"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f" * 65}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 2.5}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a/b", "schema": {}}}}, "text.format.name"),
    ({"input": "x", "top_p": 1.5}, "top_p"),
    # contents of the wrong type: they were 500s (a fuzz of the input items found them)
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0].text"),
    ({"input": [{"role": "system", "content": [{"type": "input_text", "text": None}]}]}, "input[0].content[0].text"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": 1}]}]},
     "input[0].output[0].text"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": 5, "arguments": "{}"}]}, "input[0].name"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]}, "input[0].arguments"),
])
def test_invalid_requests_name_the_field(http: httpx.Client, body: dict[str, Any], param: str):
    assert_openai_error(http.post("/v1/responses", json=body), 400, param)


def test_a_stream_is_named_sse_events_without_done(http: httpx.Client):
    response = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3, "stream": True})
    events = parse_sse(response.text)
    assert all(name == json.loads(data)["type"] for name, data in events)
    assert "[DONE]" not in response.text


# -- tools and reasoning (the scripted backend) ----------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK = "<think>\nThe user wants the weather.\n</think>\n\nIt is sunny."
QWEN25 = ServerSpec("qwen2.5-hermes", backend="scripted", args=("--tool-call-parser", "hermes"),
                    env={**ENV, "CORE_SCRIPTED_ARCHITECTURE": "Qwen2ForCausalLM",
                         "CORE_SCRIPTED_TEMPLATE": str(QWEN25_TEMPLATE)})


@pytest.fixture(scope="module")
def scripted() -> Iterator[openai.OpenAI]:
    with run_server(QWEN25) as server, openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0,
                                                     timeout=30.0) as client:
        yield client


@pytest.fixture(scope="module")
def reasoning() -> Iterator[openai.OpenAI]:
    with run_server(QWEN3_AUTO) as server, openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0,
                                                         timeout=30.0) as client:
        yield client


def test_function_tools_give_function_call_items(scripted: openai.OpenAI):
    response = scripted.responses.create(model="scripted", input=ask(CALL), tools=RESPONSES_TOOLS)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"} and response.output_text == ""


def test_streamed_function_call(scripted: openai.OpenAI):
    with scripted.responses.stream(model="scripted", input=ask(CALL), tools=RESPONSES_TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Paris"} == json.loads(final.output[0].arguments)


def test_function_call_output_goes_back_as_a_tool_message(scripted: openai.OpenAI):
    first = scripted.responses.create(model="scripted", input=ask(CALL), tools=RESPONSES_TOOLS)
    history = [*ask(CALL), *[item.model_dump() for item in first.output],
               {"type": "function_call_output", "call_id": first.output[0].call_id, "output": '{"sky": "clear"}'},
               {"role": "user", "content": "Thanks! " + "<<say>>Clear.<</say>>"}]
    answer = scripted.responses.create(model="scripted", input=history, tools=RESPONSES_TOOLS)
    assert answer.output_text == "Clear."


@pytest.mark.parametrize(("choice", "chat_choice"), [
    ("required", "required"),
    ({"type": "function", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}})])
def test_forced_tool_choice_is_the_chat_paths(scripted: openai.OpenAI, choice: Any, chat_choice: Any):
    try:
        chat = scripted.chat.completions.create(model="scripted", messages=ask(CALL), tools=TOOLS,
                                                tool_choice=chat_choice)
    except openai.BadRequestError as exc:  # this backend cannot force a call: the same 400
        with pytest.raises(openai.BadRequestError) as info:
            scripted.responses.create(model="scripted", input=ask(CALL), tools=RESPONSES_TOOLS, tool_choice=choice)
        assert info.value.body["message"] == exc.body["message"]
        return
    response = scripted.responses.create(model="scripted", input=ask(CALL), tools=RESPONSES_TOOLS, tool_choice=choice)
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == chat.choices[0].message.tool_calls[0].function.name


def test_tool_choice_none_gives_plain_text(scripted: openai.OpenAI):
    response = scripted.responses.create(model="scripted", input=ask(CALL), tools=RESPONSES_TOOLS, tool_choice="none")
    assert response.output_text == CALL


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_item_before_the_message(reasoning: openai.OpenAI, stream: bool):
    if stream:
        with reasoning.responses.stream(model="scripted", input=ask(THINK)) as events:
            kinds = [e.type for e in events]
            response = events.get_final_response()
        assert "response.reasoning_text.delta" in kinds
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    else:
        response = reasoning.responses.create(model="scripted", input=ask(THINK))
    thought, message = response.output
    assert thought.type == "reasoning" and thought.content[0].text.strip() == "The user wants the weather."
    assert message.type == "message" and response.output_text.strip() == "It is sunny."


def test_reasoning_items_go_back_as_reasoning_content(reasoning: openai.OpenAI):
    first = reasoning.responses.create(model="scripted", input=ask(THINK))
    history = [*ask(THINK), *[item.model_dump(exclude_none=True) for item in first.output],
               {"role": "user", "content": "<<say>>Bye.<</say>>"}]
    assert reasoning.responses.create(model="scripted", input=history).output_text.strip() == "Bye."


def test_a_reasoning_effort_the_api_does_not_define_is_a_400(http: httpx.Client):
    """It was accepted, and any value but "none" turned thinking on."""
    body = {"input": "hi", "max_output_tokens": 2, "reasoning": {"effort": "bogus"}}
    assert_openai_error(http.post("/v1/responses", json=body), 400, "reasoning.effort")
    body["reasoning"]["effort"] = "minimal"
    assert http.post("/v1/responses", json=body).status_code == 200


@pytest.mark.parametrize("top_logprobs", [21, -1])
def test_top_logprobs_outside_0_to_20_is_a_400(client: openai.OpenAI, model: str, top_logprobs: int):
    """It was silently ignored, as was every value."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=model, input="hi", max_output_tokens=2, top_logprobs=top_logprobs,
                                include=["message.output_text.logprobs"])
    assert raised.value.body["param"] == "top_logprobs"


def test_an_include_value_the_api_does_not_define_is_a_400(http: httpx.Client):
    body = {"input": "hi", "max_output_tokens": 2, "include": ["message.output_text.logprobz"]}
    assert_openai_error(http.post("/v1/responses", json=body), 400, "include")
    body["include"] = ["reasoning.encrypted_content"]  # what agent clients send with store false: nothing to add
    assert http.post("/v1/responses", json=body).status_code == 200


def test_included_logprobs_are_the_chat_paths(client: openai.OpenAI, model: str):
    """`include: ["message.output_text.logprobs"]` gave an empty list."""
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          logprobs=True, top_logprobs=2, **GREEDY)
    expected = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    kwargs = {"model": model, "input": "hi", "max_output_tokens": 4, "top_logprobs": 2,
              "include": ["message.output_text.logprobs"], **GREEDY}
    [message] = client.responses.create(**kwargs).output
    assert [entry.model_dump() for entry in message.content[0].logprobs] == expected
    events = list(client.responses.create(**kwargs, stream=True))
    streamed = [e.model_dump() for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    assert streamed == expected
    [done] = [ev for ev in events if ev.type == "response.output_text.done"]
    assert [e.model_dump() for e in done.logprobs] == expected
    assert [e.model_dump() for e in events[-1].response.output[0].content[0].logprobs] == expected
    assert client.responses.create(**{**kwargs, "include": []}).output[0].content[0].logprobs == []


def test_chat_reasoning_effort_is_read_as_the_responses_one(http: httpx.Client):
    """Chat's reasoning_effort was ignored whatever its value (a bogus one answered 200)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "reasoning_effort": "bogus"}
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400, "reasoning_effort")
    body["reasoning_effort"] = "minimal"
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_chat_reasoning_effort_none_turns_thinking_off(reasoning: openai.OpenAI):
    def prompt_tokens(**kwargs: Any) -> int:
        return reasoning.chat.completions.create(model="scripted", messages=ask("Hi."), **kwargs).usage.prompt_tokens

    off = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert prompt_tokens(reasoning_effort="none") == off != prompt_tokens(reasoning_effort="low") == prompt_tokens()
    assert prompt_tokens(reasoning_effort="none", extra_body={"chat_template_kwargs": {"enable_thinking": True}}) \
        == prompt_tokens()  # the request's own template switch wins



def test_an_aborted_response_is_cancelled_not_completed(client: openai.OpenAI, http: httpx.Client, model: str,
                                                        long_tokens: int):
    """An abort (/abort, a sleep, a shutdown's drain) stops the response before it finished: it was reported
    "completed", as if the model had ended it."""
    create = dict(model=model, input="Talk.", max_output_tokens=long_tokens, extra_body={"ignore_eos": True},
                  extra_headers={"X-Request-Id": "resp-to-abort"})
    response = abort_while_running(http, lambda: client.responses.create(**create), "resp-to-abort", running=1)
    assert response.id == "resp_resp-to-abort" and response.usage.output_tokens < long_tokens
    assert response.status == "cancelled" and response.incomplete_details is None
    assert response.output[-1].status == "incomplete"


def test_an_aborted_stream_ends_cancelled_not_completed(client: openai.OpenAI, http: httpx.Client, model: str,
                                                        long_tokens: int):
    """A stream ends with one of three events (completed, incomplete, failed): an aborted one ends
    `response.incomplete`, its response "cancelled" (it ended `response.completed`)."""
    stream = client.responses.create(model=model, input="Talk.", max_output_tokens=long_tokens, stream=True,
                                     extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "to-abort"})
    events = []
    for event in stream:
        if event.type == "response.output_text.delta" and events[-1].type != event.type:  # the first delta
            http.post("/abort", json={"request_id": "to-abort"}).raise_for_status()
        events.append(event)
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled"
    assert last.response.incomplete_details is None
    [item] = last.response.output
    assert item.status == "incomplete" and events[-2].item.status == "incomplete"  # output_item.done
