"""Content parts in every role (joined for the string templates of both test servers), and the served
model's names: several --served-model-name values, /v1/models/{id}, max_model_len in /v1/models."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import assert_openai_error

NAMES = ("primary-name", "alias-one", "org/alias-two")
SERVER_ARGS = ("--served-model-name", *NAMES)
GREEDY = {"temperature": 0.0, "max_tokens": 6}


def _parts(*texts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t} for t in texts]


PARTS = [
    {"role": "system", "content": _parts("Be brief.", "Be kind.")},
    {"role": "user", "content": _parts("Hello", "there")},
    {"role": "assistant", "content": _parts("Hi.")},
    {"role": "tool", "tool_call_id": "c1", "content": _parts('{"ok": 1}')},
    {"role": "user", "content": _parts("Bye")},
]
JOINED = [{**m, "content": "\n".join(p["text"] for p in m["content"])} for m in PARTS]


def test_content_parts_in_every_role_are_the_joined_text(client: openai.OpenAI, http: httpx.Client):
    with_parts = client.chat.completions.create(model=NAMES[0], messages=PARTS, **GREEDY)
    joined = client.chat.completions.create(model=NAMES[0], messages=JOINED, **GREEDY)
    assert with_parts.choices[0].message.content == joined.choices[0].message.content
    assert with_parts.usage.prompt_tokens == joined.usage.prompt_tokens
    ids = [http.post("/tokenize", json={"messages": m}).json()["tokens"] for m in (PARTS, JOINED)]
    assert ids[0] == ids[1] and len(ids[0]) == with_parts.usage.prompt_tokens


def test_content_parts_stream(client: openai.OpenAI):
    chunks = list(client.chat.completions.create(model=NAMES[1], messages=PARTS[1:2], stream=True, **GREEDY))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.model == NAMES[0] for c in chunks)


def test_refusal_and_input_text_parts_are_text(client: openai.OpenAI, http: httpx.Client):
    """An assistant turn sent back with the API's refusal part, and input_text parts, read as text (as vLLM
    does); they were handed to the string template as a list, a 400 "the chat template rejected the messages"."""
    sent = [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
            {"role": "user", "content": "Bye"}]
    as_text = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "I can't."},
               {"role": "user", "content": "Bye"}]
    reply = client.chat.completions.create(model=NAMES[0], messages=sent, **GREEDY)
    assert reply.usage.prompt_tokens == client.chat.completions.create(model=NAMES[0], messages=as_text,
                                                                       **GREEDY).usage.prompt_tokens
    ids = [http.post("/tokenize", json={"messages": m}).json()["tokens"] for m in (sent, as_text)]
    assert ids[0] == ids[1]


@pytest.mark.parametrize("part", [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "file-1"}}])
def test_a_part_of_a_type_not_served_is_a_400_naming_it(client: openai.OpenAI, http: httpx.Client, part: dict):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Listen:"}, part]}]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=NAMES[0], messages=messages, **GREEDY)
    error = assert_openai_error(raised.value.response, 400, "messages[0].content[1].type")
    assert part["type"] in error["message"] and "template" not in error["message"]


def test_models_lists_every_name_with_the_context_window(client: openai.OpenAI, http: httpx.Client):
    cards = http.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == list(NAMES)
    assert len({c["max_model_len"] for c in cards}) == 1 and cards[0]["max_model_len"] > 0
    assert [m.id for m in client.models.list().data] == list(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_retrieve_each_name(client: openai.OpenAI, name: str):
    card = client.models.retrieve(name)
    assert card.id == name and card.object == "model" and card.owned_by == "core"


def test_retrieve_an_unknown_model_is_a_404(client: openai.OpenAI, http: httpx.Client):
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    assert_openai_error(http.get("/v1/models/nope"), 404, "model")


@pytest.mark.parametrize("name", NAMES)
def test_every_name_is_accepted_and_the_first_reported(client: openai.OpenAI, name: str):
    chat = client.chat.completions.create(model=name, messages=JOINED[1:2], **GREEDY)
    text = client.completions.create(model=name, prompt="Once", **GREEDY)
    assert chat.model == text.model == NAMES[0]


def test_another_name_is_a_404(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=JOINED[1:2], **GREEDY)
