"""The chat page in a real browser against `core serve` on the "scripted" model (scripted_backend_plugin.py),
which replies with the text its prompt scripts: the test chooses the model's output and everything else
(the Qwen3 chat template, its reasoning and tool-call parsers, the engine, the server, the page) is real.
So: hostile HTML in a reply stays text, reasoning is folded, a tool call shows as one, and the API key
flow of a server started with --api-key.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from chromium_page import open_chat, send, stored_conversations, wait_reply_done
from conftest import RunningServer, ServerSpec, run_server
from scripted_backend_plugin import say

pytest.importorskip("core_templates")

KEY = "browser-key"
QWEN3 = ServerSpec("scripted-qwen3", backend="scripted", args=("--api-key", KEY),
                   env={"CORE_PLUGINS": "templates", "CORE_EXTRA_PLUGINS": "scripted_backend_plugin",
                        "CORE_SCRIPTED_ARCHITECTURE": "Qwen3ForCausalLM"})
WITH_KEY = {"apiKey": KEY}
HOSTILE = '<img src=x onerror=alert(1)> <script>alert(2)</script> [click](javascript:alert(3))'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def scripted() -> Iterator[RunningServer]:
    with run_server(QWEN3, api_key=KEY) as server:
        yield server


def dialogs(page: Any) -> list[str]:
    seen: list[str] = []
    page.on("dialog", lambda dialog: (seen.append(dialog.message), dialog.dismiss()))
    return seen


def test_html_in_a_reply_is_shown_as_text(browser, scripted):
    page = open_chat(browser, scripted.base_url, WITH_KEY)
    alerts = dialogs(page)
    send(page, "Repeat: " + say(f"Look: {HOSTILE} and **bold** with `<b>code</b>`\n\n```html\n{HOSTILE}\n```"))
    content = wait_reply_done(page).locator(".content")
    assert HOSTILE.replace("[click](javascript:alert(3))", "click") in content.inner_text()
    assert content.locator("pre code").inner_text() == HOSTILE
    assert content.locator("strong").inner_text() == "bold" and content.locator("p code").inner_text() == "<b>code</b>"
    assert page.locator("#messages img, #messages script, #messages a, #messages b").count() == 0
    page.wait_for_timeout(300)  # an onerror would have fired by now
    assert alerts == [] and not page.errors
    user = page.locator(".message.user .content").inner_text()
    assert HOSTILE in user  # the user's own text is shown as typed


def test_reasoning_is_folded_and_tool_calls_are_shown_as_calls(browser, scripted):
    page = open_chat(browser, scripted.base_url, {**WITH_KEY, "tools": json.dumps(TOOLS)})
    send(page, "Weather? " + say(f"<think>\nThe user wants *the weather*.\n</think>\n\nLet me look.\n{CALL}"))
    reply = wait_reply_done(page)
    fold = reply.locator("details.reasoning")
    assert fold.get_attribute("open") is None and fold.locator("summary").inner_text() == "Reasoning"
    assert not fold.locator(".reasoning-text").is_visible()
    fold.locator("summary").click()
    assert fold.locator(".reasoning-text em").inner_text() == "the weather"
    assert reply.locator(".content").inner_text() == "Let me look."
    call = reply.locator(".tool-call")
    assert call.locator(".tool-name").inner_text() == "get_weather"
    assert json.loads(call.locator("pre").inner_text()) == {"city": "Paris"}
    [message] = [m for m in stored_conversations(page)[0]["messages"] if m["role"] == "assistant"]
    assert message["finish"] == "tool_calls" and message["reasoning"].strip() == "The user wants *the weather*."
    with page.expect_request("**/v1/chat/completions") as request:  # the call goes back with the history
        send(page, "Thanks. " + say("Done."))
    sent = request.value.post_data_json
    assert sent["tools"] == TOOLS and sent["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert wait_reply_done(page).locator(".content").inner_text() == "Done."


def test_the_page_is_served_without_the_key_and_every_api_call_sends_it(browser, scripted):
    page = open_chat(browser, scripted.base_url)
    requests: list[Any] = []
    page.on("request", lambda request: requests.append(request))
    assert page.evaluate("() => fetch('/').then((r) => r.status)") == 200  # the page needs no key
    notice = page.locator("#notice")
    assert "needs an API key" in notice.inner_text()
    assert page.locator("#settings").get_attribute("open") is not None  # the key field is offered
    assert page.evaluate("() => document.activeElement.name") == "apiKey"
    page.fill("[name=apiKey]", KEY)
    page.click("#save-settings")
    page.wait_for_function("() => document.querySelector('#model').options.length > 0")
    assert notice.is_hidden() and page.locator("#model").input_value() == "scripted"
    send(page, say("Hello with a key."))
    assert wait_reply_done(page).locator(".content").inner_text() == "Hello with a key."
    api = [r for r in requests if r.url.split("/", 3)[3].startswith(("v1/", "info"))]
    assert api and all(r.headers.get("authorization") == f"Bearer {KEY}" for r in api)
    page.reload()  # the key stays in this browser
    page.wait_for_function("() => document.querySelector('#model').options.length > 0")
    assert page.evaluate("() => JSON.parse(localStorage.getItem('core-chat.settings')).apiKey") == KEY

    page.evaluate("""() => localStorage.setItem('core-chat.settings', JSON.stringify({apiKey: 'wrong'}))""")
    page.reload()  # a wrong key: the same offer, and a turn says why it failed
    assert "needs an API key" in page.locator("#notice").inner_text()
    page.click("#cancel-settings")
    send(page, say("Never said."))
    assert "API key" in wait_reply_done(page).locator(".error").inner_text()
    assert not page.errors
