"""Structured output with a reasoning model: `core serve --reasoning-parser deepseek_r1` on a tiny random
model whose template opens ``<think>``. The constraint applies after the reasoning section (as vLLM
does): `reasoning_content` is free text and `content` validates; a prompt that already closed the
reasoning (``enable_thinking=False``) is constrained from its first token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from conftest import RunningServer, ServerSpec, start_server, stop_server

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow

THINK, END_THINK = "<think>", "</think>"
# DeepSeek-R1 style: the prompt opens <think>; enable_thinking=False writes an empty, closed block.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"enum": [1, 2, 3]}},
          "required": ["answer", "n"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
END_THINK_BIAS = 4.0  # makes the random model end its reasoning after a few tokens
TIMEOUT_S = 120.0


def build_tiny_reasoner(out: Path, seed: int = 0) -> Path:
    """The tiny Llama of tiny_checkpoint.py with <think> and </think> tokens and the template above; it
    writes printable ASCII and </think> only (the others silenced; eos comes when a constraint forces it)."""
    import torch
    from tiny_checkpoint import (
        CONTEXT_WINDOW,
        GENERATION_CONFIG,
        printable_ascii_ids,
        pytorch_test_builders,
        silence_tokens_,
    )
    from transformers import AutoModelForCausalLM

    builders = pytorch_test_builders()
    tokenizer = builders.tiny_tokenizer()
    tokenizer.add_tokens([THINK, END_THINK])
    tokenizer.chat_template = CHAT_TEMPLATE
    config = builders.tiny_config("llama", max_position_embeddings=CONTEXT_WINDOW, vocab_size=len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    builders.reinit_(model, seed=seed)
    allowed = {*printable_ascii_ids(tokenizer), tokenizer.convert_tokens_to_ids(END_THINK)}
    silence_tokens_(model, [i for i in range(config.vocab_size) if i not in allowed])
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return out


@pytest.fixture(scope="module")
def reasoner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, int]]:
    pytest.importorskip("core_pytorch_backend", reason="the tiny model needs the pytorch backend plugin")
    pytest.importorskip("transformers", reason="building the tiny checkpoint needs transformers")
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar")
    path = build_tiny_reasoner(tmp_path_factory.mktemp("tiny-reasoner"))
    spec = ServerSpec("tiny-reasoner", backend="pytorch", model=str(path),
                      args=("--kv-cache-memory", "0.02", "--reasoning-parser", "deepseek_r1",
                            "--served-model-name", "m"),
                      env={"CORE_PLUGINS": "pytorch_backend,templates"})
    server = start_server(spec)
    added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    end_id = next(t["id"] for t in added if t["content"] == END_THINK)
    try:
        yield server, end_id
    finally:
        status, log = stop_server(server), server.log()
        server.log_path.unlink(missing_ok=True)
    assert status == 0 and "Traceback" not in log, log


@pytest.fixture
def client(reasoner: tuple[RunningServer, int]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=reasoner[0].url("/v1"), api_key="unused", max_retries=0, timeout=TIMEOUT_S) as c:
        yield c


def test_the_constraint_applies_after_the_reasoning(client, reasoner):
    _, end_id = reasoner
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "yes or no?"}], max_tokens=120, n=4, temperature=1.0,
        seed=11, logit_bias={str(end_id): END_THINK_BIAS}, response_format=RESPONSE_FORMAT)
    reasoned = 0
    for choice in out.choices:
        message = choice.message
        reasoning = getattr(message, "reasoning_content", None)
        if choice.finish_reason != "stop":  # still reasoning at max_tokens: nothing to validate
            assert choice.finish_reason == "length" and not message.content, choice
            continue
        jsonschema.validate(json.loads(message.content), SCHEMA)
        assert isinstance(reasoning, str)
        reasoned += bool(reasoning)
    assert reasoned >= 1, out  # free text before </think>, which no JSON constraint would allow


def test_streamed_reasoning_then_valid_content(client, reasoner):
    _, end_id = reasoner
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "yes or no?"}], max_tokens=120, temperature=1.0, seed=5,
        logit_bias={str(end_id): END_THINK_BIAS}, response_format=RESPONSE_FORMAT, stream=True)
    reasoning, content, finish = "", "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop", (reasoning, content)
    jsonschema.validate(json.loads(content), SCHEMA)


def test_a_prompt_that_closed_the_reasoning_is_constrained_from_the_start(client):
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "yes or no?"}], max_tokens=60, temperature=1.0, seed=3,
        response_format=RESPONSE_FORMAT, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and getattr(choice.message, "reasoning_content", None) is None
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
