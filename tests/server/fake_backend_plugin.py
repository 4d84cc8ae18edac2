"""A test plugin for `core serve` subprocesses: backend "fake" (core.testing.fake) and template "tiny-chatml".

Loaded with CORE_EXTRA_PLUGINS=fake_backend_plugin (and this folder on PYTHONPATH). The fake backend's
speed is set by CORE_FAKE_STEP_DELAY (seconds per decode step), so tests can keep requests in flight.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from core import hookimpl
from core.chat_template import ChatTemplate
from core.config import EngineConfig
from core.testing.fake import FakeBackend, next_token_rule

TEMPLATE_NAME = "tiny-chatml"
FAIL_MARKER = list(b"BOOM")
FAIL_AFTER_TOKENS = 3
# A message holding "SLOW_RENDER:<seconds>" takes that long to render: a stand-in for a huge prompt.
SLOW_RENDER = re.compile(r"SLOW_RENDER:([0-9.]+)")
# A message holding this makes rendering raise a plain exception: a stand-in for a bug (a 500).
RAISE_IN_RENDER = "RAISE_IN_RENDER"


class TinyChatML(ChatTemplate):
    """ChatML without special tokens: the byte tokenizer spells every marker out. It reads content as a
    string (text parts reach it joined); a message with images still comes as parts."""

    stop_strings = ("<|im_end|>",)
    content_format = "string"

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> str:
        parts = []
        for message in messages:
            if slow := SLOW_RENDER.search(_text(message.get("content"))):
                time.sleep(float(slow.group(1)))
            if RAISE_IN_RENDER in _text(message.get("content")):
                raise RuntimeError("injected render failure (secret internals)")
        if tools:
            parts.append(f"<|im_start|>system\nTools: {json.dumps(list(tools), sort_keys=True)}<|im_end|>\n")
        for message in messages:
            parts.append(f"<|im_start|>{message['role']}\n{_text(message.get('content'))}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    return "" if content is None else str(content)


def exploding_rule(context: Sequence[int], choice: int) -> int:
    """The fake's usual rule, but a context that ends its prompt with "BOOM" fails after 3 tokens."""
    for start in range(len(context) - len(FAIL_MARKER), -1, -1):
        if list(context[start:start + len(FAIL_MARKER)]) == FAIL_MARKER:
            if len(context) - start - len(FAIL_MARKER) >= FAIL_AFTER_TOKENS:
                raise RuntimeError("injected failure (secret internals)")
            break
    return next_token_rule(context, choice)


def make_fake_backend(config: EngineConfig) -> FakeBackend:
    """The factory `core serve --backend fake` calls."""
    return FakeBackend(max_model_len=config.max_model_len or 512, num_blocks=4096, block_size=config.block_size,
                       step_delay=float(os.environ.get("CORE_FAKE_STEP_DELAY", "0.001")), next_token=exploding_rule)


@hookimpl
def core_register_backends(register: Any) -> None:
    register("fake", make_fake_backend, description="deterministic test backend")


@hookimpl
def core_register_chat_templates(register: Any) -> None:
    register(TEMPLATE_NAME, lambda tokenizer: TinyChatML())
