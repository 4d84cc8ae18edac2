"""The chat page in a real browser (Debian's chromium) against `core serve` on the tiny random-weight Llama
(the real pytorch backend): streaming, Stop (the server frees the request), the keyboard, regenerate and
edit, conversations kept in localStorage, the status view, and narrow screens. Screenshots go to each
test's tmp dir.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from chromium_page import open_chat, send, stored_conversations, wait_reply_done
from conftest import TINY_LLAMA, RunningServer, ServerPool, resolve_spec
from server_helpers import metrics, wait_counter, wait_idle
from tiny_checkpoint import CONTEXT_WINDOW

STREAMING_TEXT = ("() => { const c = document.querySelector('.message.assistant.streaming .content');"
                  " return c !== null && c.textContent.length > 0; }")
GREEDY = {"temperature": "0", "seed": "7"}


@pytest.fixture(scope="module")
def llama(request: pytest.FixtureRequest, server_pool: ServerPool) -> RunningServer:
    return server_pool.get(resolve_spec(TINY_LLAMA, request), (), {}, None)


@pytest.fixture
def http(llama: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=llama.base_url, timeout=30.0) as client:
        client.post("/abort", json={"all": True}).raise_for_status()
        yield client


def chat_request(page: Any, action: Any) -> dict[str, Any]:
    """The body of the chat request that `action()` makes the page send."""
    with page.expect_request("**/v1/chat/completions") as request:
        action()
    return request.value.post_data_json


def test_a_message_streams_in_and_the_page_is_photographed(browser, llama, http, tmp_path):
    page = open_chat(browser, llama.base_url, {**GREEDY, "max_tokens": "300"})
    assert page.locator("#attach").is_hidden()  # a text-only model: no image button
    assert page.locator("#model").input_value() == http.get("/v1/models").json()["data"][0]["id"]
    body = chat_request(page, lambda: send(page, "Hello there"))
    assert body["messages"] == [{"role": "user", "content": "Hello there"}]
    assert body["stream"] is True and body["max_tokens"] == 300 and body["temperature"] == 0
    page.wait_for_function(STREAMING_TEXT)  # text is on the page while the reply still streams
    partial = page.locator(".message.assistant .content").inner_text()
    reply = wait_reply_done(page)
    assert len(reply.locator(".content").inner_text()) > len(partial) > 0
    stored = stored_conversations(page)[0]["messages"][-1]
    assert stored["usage"]["completion_tokens"] == 300 and stored["finish"] == "length"
    assert reply.locator(".ending").inner_text() == "Stopped at the token limit."
    page.click("#toggle-status")
    page.wait_for_selector("#status-list dd")
    status = page.locator("#status-list").inner_text()
    assert "pytorch" in status and f"{CONTEXT_WINDOW:,} tokens" in status and "0 running" in status
    page.screenshot(path=str(tmp_path / "chat.png"))
    assert (tmp_path / "chat.png").stat().st_size > 10_000
    assert not page.errors


def test_stop_ends_the_stream_and_the_running_gauge_returns_to_zero(browser, llama, http):
    page = open_chat(browser, llama.base_url, {"max_tokens": str(CONTEXT_WINDOW - 64)})
    page.click("#toggle-status")
    send(page, "Write for a long time.")
    page.wait_for_function(STREAMING_TEXT)
    before = metrics(http)
    assert before["core:num_requests_running"] == 1
    page.keyboard.press("Escape")  # Esc stops, as the Stop button does
    reply = wait_reply_done(page)
    assert reply.locator(".ending").inner_text() == "Stopped."
    wait_idle(http)  # no request running, no KV block in use
    wait_counter(http, before, 'core:requests_total{finished_reason="abort"}', 1)
    page.wait_for_function("() => document.querySelector('#status-list [data-running]')?.dataset.running === '0'")
    stored = stored_conversations(page)[0]["messages"][-1]
    assert stored["finish"] == "stopped" and stored["content"]  # what had arrived is kept

    page.click("#new-chat")  # (this history and max_tokens would not fit the context window)
    send(page, "Again.")  # the Stop button itself
    page.wait_for_function(STREAMING_TEXT)
    page.click("#stop")
    assert wait_reply_done(page).locator(".ending").inner_text() == "Stopped."
    wait_idle(http)
    assert not page.errors


def test_keyboard_regenerate_edit_and_the_whole_history_each_turn(browser, llama, http):
    page = open_chat(browser, llama.base_url, {**GREEDY, "max_tokens": "6", "system": "Be brief."})
    page.fill("#prompt", "first line")
    page.press("#prompt", "Shift+Enter")
    page.keyboard.type("second line")
    assert page.input_value("#prompt") == "first line\nsecond line"
    assert page.locator(".message").count() == 0  # Shift+Enter did not send
    question = {"role": "user", "content": "first line\nsecond line"}
    body = chat_request(page, lambda: page.press("#prompt", "Enter"))
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, question]
    first = wait_reply_done(page).locator(".content").inner_text()
    assert page.locator(".message.user .content").inner_text() == "first line\nsecond line"

    body = chat_request(page, lambda: page.click("[data-action=regenerate]"))
    assert body["messages"][1:] == [question]  # the old reply is not sent back
    wait_reply_done(page)
    assert page.locator(".message.assistant").count() == 1 and first

    page.click("[data-action=edit]")
    assert page.input_value("#prompt") == "first line\nsecond line" and page.locator(".message").count() == 0
    body = chat_request(page, lambda: send(page, "an edited question"))
    assert body["messages"][1:] == [{"role": "user", "content": "an edited question"}]
    wait_reply_done(page)
    reply = stored_conversations(page)[0]["messages"][1]["content"]
    body = chat_request(page, lambda: send(page, "a follow-up"))
    assert body["messages"][1:] == [{"role": "user", "content": "an edited question"},
                                    {"role": "assistant", "content": reply},
                                    {"role": "user", "content": "a follow-up"}]
    wait_reply_done(page)
    assert not page.errors


def test_conversations_are_kept_in_the_browser(browser, llama, http):
    page = open_chat(browser, llama.base_url, {"max_tokens": "4"})
    send(page, "the first conversation")
    wait_reply_done(page)
    page.click("#new-chat")
    assert page.locator(".message").count() == 0
    send(page, "the second conversation")
    wait_reply_done(page)
    page.reload()
    titles = page.locator("#conversations .open")
    titles.first.wait_for()
    assert titles.all_inner_texts() == ["the second conversation", "the first conversation"]
    page.click("#conversations li:nth-child(2) .open")
    assert page.locator(".message.user .content").inner_text() == "the first conversation"
    page.click("#conversations li:nth-child(1) .remove")  # delete the other one
    assert page.locator("#conversations li").count() == 1
    assert [c["title"] for c in stored_conversations(page)] == ["the first conversation"]


def test_narrow_screens_fit_and_the_sidebar_slides_in(browser, llama, http, tmp_path):
    page = open_chat(browser, llama.base_url, {"max_tokens": "40"}, width=380, height=720)
    send(page, "A question from a phone, long enough to wrap over several lines of a narrow screen.")
    wait_reply_done(page)
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    right = "document.querySelector('#sidebar').getBoundingClientRect().right"
    assert page.evaluate(right) <= 0  # off screen until asked for
    page.screenshot(path=str(tmp_path / "narrow.png"))
    page.click("#toggle-sidebar")
    page.wait_for_function(f"() => {right} >= document.querySelector('#sidebar').offsetWidth")
    page.click("#conversations .open")  # choosing a conversation closes it again
    page.wait_for_function(f"() => {right} <= 0")
