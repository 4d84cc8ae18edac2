"""OpenAI routes through the official client: texts, usage, n, streaming, logprobs, request ids."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from server_helpers import MESSAGES, assert_openai_error, wait_counter, wait_idle

GREEDY = {"temperature": 0.0, "max_tokens": 12}


def stream_text(client: openai.OpenAI, model: str, **kwargs) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_models_lists_the_served_model(client: openai.OpenAI, model: str):
    models = client.models.list().data
    assert [m.id for m in models] == [model]


def test_chat_stream_and_non_stream_greedy_texts_are_equal(client: openai.OpenAI, model: str):
    whole = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    text, chunks = stream_text(client, model, **GREEDY)
    assert whole.choices[0].message.content == text and text
    assert whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"  # the first delta carries the role
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1


def test_completion_stream_and_non_stream_are_equal(client: openai.OpenAI, model: str):
    whole = client.completions.create(model=model, prompt="Once upon a time", **GREEDY)
    chunks = list(client.completions.create(model=model, prompt="Once upon a time", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_usage_counts_are_exact(client: openai.OpenAI, model: str, http: httpx.Client):
    prompt_ids = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    whole = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == GREEDY["max_tokens"]
    assert whole.usage.total_tokens == len(prompt_ids) + GREEDY["max_tokens"]
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0


def test_include_usage_adds_a_final_chunk_with_empty_choices(client: openai.OpenAI, model: str):
    whole = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    _, chunks = stream_text(client, model, stream_options={"include_usage": True}, **GREEDY)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_n_with_seed_gives_indexed_choices(client: openai.OpenAI, model: str):
    sampled = {"n": 3, "seed": 7, "temperature": 1.0, "max_tokens": 6}
    response = client.chat.completions.create(model=model, messages=MESSAGES, **sampled)
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert response.usage.completion_tokens == 3 * 6
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **sampled))
    streamed = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
                for i in range(3)}
    assert streamed == {c.index: c.message.content for c in response.choices}  # the seed reproduces them
    assert len(set(streamed.values())) == 3  # three samples, not one copied


def test_chat_logprobs_shapes(client: openai.OpenAI, model: str):
    response = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, logprobs=True,
                                              top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, logprobs=True,
                                                 top_logprobs=2, stream=True))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_without_max_tokens_stops_at_the_apis_default_of_16(client: openai.OpenAI, model: str,
                                                                       stream: bool):
    # OpenAI's legacy completions (and vLLM) default max_tokens to 16, not to the rest of the context window.
    options = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    response = client.completions.create(model=model, prompt="Once upon a time", extra_body={"ignore_eos": True},
                                         **options)
    usage = [c for c in response if c.usage][-1].usage if stream else response.usage
    assert usage.completion_tokens == 16


def test_completion_logprobs_shapes(client: openai.OpenAI, model: str):
    response = client.completions.create(model=model, prompt="abc", max_tokens=3, logprobs=2)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert all(len(alternatives) <= 2 for alternatives in lp.top_logprobs)


def test_list_prompt_runs_independent_requests(client: openai.OpenAI, model: str):
    single = [client.completions.create(model=model, prompt=p, **GREEDY).choices[0].text for p in ("ab", "cd")]
    batch = client.completions.create(model=model, prompt=["ab", "cd"], **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == single
    chunks = list(client.completions.create(model=model, prompt=["ab", "cd"], stream=True, **GREEDY))
    assert ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in (0, 1)] == single


def test_token_id_prompts(client: openai.OpenAI, model: str, http: httpx.Client):
    ids = http.post("/tokenize", json={"prompt": "hello"}).json()["tokens"]
    by_text = client.completions.create(model=model, prompt="hello", **GREEDY)
    by_ids = client.completions.create(model=model, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    two = client.completions.create(model=model, prompt=[ids, ids], **GREEDY)
    assert [c.text for c in two.choices] == [by_text.choices[0].text] * 2


def test_stop_string_ends_the_text(client: openai.OpenAI, model: str):
    text = client.completions.create(model=model, prompt="xyz", **GREEDY).choices[0].text
    stop = text[3:5]
    stopped = client.completions.create(model=model, prompt="xyz", stop=[stop], **GREEDY).choices[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text and text.startswith(stopped.text)


def test_tools_reach_the_chat_template(client: openai.OpenAI, model: str, server):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    plain = client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY)
    with_tools = client.chat.completions.create(model=model, messages=MESSAGES, tools=tools, **GREEDY)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    hidden = client.chat.completions.create(model=model, messages=MESSAGES, tools=tools, tool_choice="none", **GREEDY)
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens


def test_request_id_header_is_the_session_and_duplicates_conflict(http: httpx.Client, long_tokens: int):
    before = wait_idle(http)
    body = {"messages": MESSAGES, "max_tokens": long_tokens, "stream": True}
    headers = {"X-Request-Id": "dup-1"}
    started, release = threading.Event(), threading.Event()

    def first() -> None:  # holds its stream open until the second request was answered
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            for _ in response.iter_lines():
                started.set()
                release.wait(10)
                break

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert started.wait(10)
        second = http.post("/v1/chat/completions", json={**body, "stream": False}, headers=headers)
        assert_openai_error(second, 409)
    finally:
        release.set()
        thread.join(10)
    # The first request was aborted when its client left; it is counted once its session is closed.
    wait_counter(http, before, 'core:requests_total{finished_reason="abort"}', 1)
    ok = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "request_id": "dup-1"})
    assert ok.status_code == 200 and ok.json()["id"] == "chatcmpl-dup-1"


@pytest.mark.parametrize("stream", [False, True])
def test_unset_sampling_fields_are_not_defaulted_by_the_server(client: openai.OpenAI, model: str, stream: bool):
    # Nothing but messages: the model's generation_config applies (the engine does that); it must work.
    response = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, stream=stream)
    if stream:
        assert sum(1 for c in response if c.choices and c.choices[0].delta.content) >= 1
    else:
        assert response.usage.completion_tokens == 3


def test_generation_config_defaults_apply_and_request_values_override(server, client: openai.OpenAI, model: str):
    if server.spec.is_fake:
        pytest.skip("the fake backend's tokens do not depend on sampling settings")
    # The tiny checkpoint's generation_config.json says do_sample=false: greedy unless the request says not.
    greedy = client.completions.create(model=model, prompt="defaults", **GREEDY).choices[0].text
    unset = [client.completions.create(model=model, prompt="defaults", max_tokens=12, seed=s).choices[0].text
             for s in (1, 2)]
    assert unset == [greedy, greedy]
    sampled = [client.completions.create(model=model, prompt="defaults", max_tokens=12, temperature=1.0,
                                         seed=s).choices[0].text for s in (1, 2)]
    assert len({greedy, *sampled}) == 3


def test_vllm_allowed_token_ids_and_truncate_prompt_tokens(client: openai.OpenAI, model: str, http: httpx.Client):
    allowed = http.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False}).json()["tokens"]
    out = client.completions.create(model=model, prompt="xyz", max_tokens=12, temperature=1.0, seed=3,
                                    extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    ids = http.post("/tokenize", json={"prompt": out.choices[0].text, "add_special_tokens": False}).json()["tokens"]
    assert out.usage.completion_tokens == 12 and set(ids) <= set(allowed), (out.choices[0].text, ids, allowed)
    whole = client.completions.create(model=model, prompt="a longer prompt", **GREEDY)
    cut = client.completions.create(model=model, prompt="a longer prompt", extra_body={"truncate_prompt_tokens": 3},
                                    **GREEDY)
    assert cut.usage.prompt_tokens == 3 < whole.usage.prompt_tokens
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5


@pytest.mark.parametrize(("field", "value"), [("bad_words", ["no"]), ("use_beam_search", True),
                                              ("allowed_token_ids", [10**9]), ("truncate_prompt_tokens", 0)])
def test_vllm_fields_not_served_are_400s_naming_them(http: httpx.Client, model: str, field, value):
    response = http.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 2,
                                                       field: value})
    assert_openai_error(response, 400, field)


def test_vllm_continue_final_message_and_a_request_chat_template(http: httpx.Client, model: str):
    prefill = [*MESSAGES, {"role": "assistant", "content": "Sure, here"}]
    body = {"model": model, "messages": prefill, "max_tokens": 2, "add_generation_prompt": False}
    continued = http.post("/tokenize", json={"messages": prefill, "add_generation_prompt": False}).json()["count"]
    response = http.post("/v1/chat/completions", json={**body, "continue_final_message": True})
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == continued
    both = {**body, "continue_final_message": True, "add_generation_prompt": True}
    assert_openai_error(http.post("/v1/chat/completions", json=both), 400, "continue_final_message")
    not_last = {**body, "messages": MESSAGES, "continue_final_message": True}
    assert_openai_error(http.post("/v1/chat/completions", json=not_last), 400, "continue_final_message")
    template = {**body, "chat_template": "{{ messages[0]['content'] }}"}
    assert_openai_error(http.post("/v1/chat/completions", json=template), 400, "chat_template")
