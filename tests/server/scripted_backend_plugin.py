"""A test plugin for `core serve`: backend "scripted", a fake model that says what its prompt tells it to.

Why it exists: a random-weight model cannot be made to emit a tool call or a ``<think>`` block, so the
server's reasoning and tool-call parsing cannot be driven by one. This backend (core.testing.fake's
FakeBackend with a byte tokenizer) replies with exactly the text between the last ``<<say>>`` and
``<</say>>`` in its prompt, then ends its turn; everything else on the path (the chat template, the
engine, stop handling, the parsers, the server and the clients) is the real code. It poses as the
architecture in CORE_SCRIPTED_ARCHITECTURE and ships the chat template in the file CORE_SCRIPTED_TEMPLATE
as the model's own, so the server chooses parsers for it as it would for that model family.

Loaded with CORE_EXTRA_PLUGINS=scripted_backend_plugin (and this folder on PYTHONPATH).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core import hookimpl
from core.backend import ModelInfo
from core.config import EngineConfig
from core.testing.fake import EOS, ByteTokenizer, FakeBackend

SAY, END_SAY = "<<say>>", "<</say>>"


def say(text: str) -> str:
    """The instruction that makes the scripted model reply `text`."""
    return f"{SAY}{text}{END_SAY}"


def script_from_prompt(prompt_ids: Sequence[int]) -> list[int] | None:
    """The byte tokens of the text the prompt's last <<say>> block asks for; None when it has none."""
    prompt = ByteTokenizer().decode(prompt_ids)
    start = prompt.rfind(SAY)
    end = prompt.find(END_SAY, start)
    if start < 0 or end < 0:
        return None
    return list(prompt[start + len(SAY):end].encode("utf-8"))


def make_scripted_backend(config: EngineConfig) -> FakeBackend:
    """The factory `core serve --backend scripted` calls."""
    template = os.environ.get("CORE_SCRIPTED_TEMPLATE")
    info = ModelInfo(name="scripted", architecture=os.environ.get("CORE_SCRIPTED_ARCHITECTURE", "FakeForCausalLM"),
                     max_model_len=config.max_model_len or 4096, eos_token_ids=(EOS,),
                     chat_template=Path(template).read_text(encoding="utf-8") if template else None,
                     vocab_size=ByteTokenizer.vocab_size)
    return FakeBackend(max_model_len=info.max_model_len, num_blocks=8192, block_size=config.block_size,
                       script_for=script_from_prompt, model_info=info)


@hookimpl
def core_register_backends(register: Any) -> None:
    register("scripted", make_scripted_backend, description="replies with the text its prompt scripts")
