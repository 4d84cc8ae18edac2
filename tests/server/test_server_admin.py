"""Admin routes: sleep/wakeup with 503s in each protocol's shape, abort, tokenizer, health, version."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from conftest import FAKE, run_server, stop_server
from server_helpers import (
    MESSAGES,
    abort_while_running,
    assert_anthropic_error,
    assert_openai_error,
    metrics,
    wait_idle,
)

CHAT = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0.0}


def test_sleep_makes_inference_routes_503_in_their_protocol_then_wakeup_restores(http: httpx.Client,
                                                                               client: openai.OpenAI, model: str):
    before = http.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
    assert http.post("/sleep?level=1").status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                       ("/v1/chat/completions", {**CHAT, "stream": True})):
        error = assert_openai_error(http.post(path, json=body), 503)
        assert "sleeping" in error["message"] and "/wakeup" in error["message"]
    error = assert_anthropic_error(http.post("/v1/messages", json={"max_tokens": 4, "messages": MESSAGES}), 503)
    assert "sleeping" in error["message"]
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert info.value.status_code == 503
    assert http.get("/health").json() == {"status": "sleeping"}
    assert http.get("/v1/models").status_code == 200
    assert metrics(http)["core:is_sleeping"] == 1
    assert http.post("/wakeup?tags=weights").json()["asleep"] == ["kv_cache"]
    assert_openai_error(http.post("/v1/chat/completions", json=CHAT), 503)
    assert http.post("/wakeup?tags=kv_cache").json() == {"is_sleeping": False, "asleep": []}
    after = http.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
    assert after == before and http.get("/health").json() == {"status": "ok"}


def test_sleep_level_2_and_wakeup_all(http: httpx.Client):
    assert http.post("/sleep", params={"level": "2"}).status_code == 200
    assert http.post("/sleep", params={"level": "2"}).status_code == 200  # idempotent
    assert http.post("/wakeup").json() == {"is_sleeping": False, "asleep": []}


@pytest.mark.parametrize("level", ["0", "3", "x", "1.0", ""])
def test_bad_sleep_level_is_400(http: httpx.Client, level: str):
    assert_openai_error(http.post("/sleep", params={"level": level}), 400, "level")
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def test_unknown_wakeup_tag_is_400(http: httpx.Client):
    assert_openai_error(http.post("/wakeup?tags=gpu"), 400, "tags")


def test_abort_by_id_ends_the_stream_and_frees_blocks(http: httpx.Client, long_tokens: int):
    received: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {**CHAT, "max_tokens": long_tokens, "stream": True, "request_id": "to-abort"}
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line:
                    received.append(line)
                    started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(10)
    assert http.post("/abort", json={"request_id": "to-abort"}).json() == {"aborted": 1}
    thread.join(10)
    assert not thread.is_alive() and received[-1] == "data: [DONE]"
    assert '"finish_reason":"abort"' in "".join(received)
    wait_idle(http)
    error = assert_openai_error(http.post("/abort", json={"request_id": "to-abort"}), 404, "request_id")
    assert "'to-abort'" in error["message"]  # no longer in flight: named, not a silent {"aborted": 0}
    assert http.post("/abort", json={"all": True}).json() == {"aborted": 0}
    assert_openai_error(http.post("/abort", json={}), 400, "request_id")


def test_abort_by_id_reaches_every_prompt_of_a_completions_list(http: httpx.Client, long_tokens: int):
    """A list of prompts sent with a request id runs as one session per prompt (id-0, id-1, ...), and the
    response is named after the id: aborting by that id stops them all (it answered 404 while both ran on)."""
    body = {"prompt": ["Once upon a time", "Tell me"], "max_tokens": long_tokens, "ignore_eos": True,
            "request_id": "a-list"}
    answer = abort_while_running(http, lambda: http.post("/v1/completions", json=body), "a-list", running=2)
    assert [c["finish_reason"] for c in answer.json()["choices"]] == ["abort", "abort"]
    assert answer.json()["id"] == "cmpl-a-list"
    wait_idle(http)
    assert_openai_error(http.post("/abort", json={"request_id": "a-list"}), 404, "request_id")


def test_tokenize_detokenize_round_trip(http: httpx.Client):
    tokens = http.post("/tokenize", json={"prompt": "héllo wörld", "add_special_tokens": False}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "héllo wörld"}
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > tokens["count"]
    assert_openai_error(http.post("/tokenize", json={}), 400, "prompt")
    assert_openai_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")


def test_health_and_version(http: httpx.Client):
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/version").json()["version"]


def test_ctrl_c_shuts_down_cleanly_during_a_stream():
    # The fake only: every shared server (the tiny model's too) is stopped the same way at the end of the
    # session, where conftest's ServerPool checks the exit status and the log.
    with run_server(FAKE) as own:
        with httpx.Client(base_url=own.base_url, timeout=30) as http:
            body = {"prompt": "x", "max_tokens": 450, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as response:
                next(response.iter_lines())
                assert stop_server(own) == 0
        log = own.log()
        assert "engine closed" in log and "Traceback" not in log
