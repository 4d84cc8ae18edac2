"""Reasoning between ``<think>`` and ``</think>`` (DeepSeek-R1, Qwen3, QwQ and their distills; Qwen3.5,
Nemotron-H, LFM2.5, MiniMax-M1).

A response starts inside reasoning when the prompt left a ``<think>`` block open (DeepSeek-R1's template
ends the prompt with ``<think>\\n``); otherwise an optional ``<think>`` at its start opens it. Without a
prompt, DeepSeek-R1 assumes reasoning (it always thinks) and Qwen3 waits for the tag.
``chat_template_kwargs={"enable_thinking": False}`` makes everything content. Reasoning and the content
after it are stripped of surrounding whitespace; a response with no reasoning is returned unchanged.
"""

from __future__ import annotations

from typing import Any

from core.parsers import ReasoningDelta, ReasoningParser
from core_templates.parsers.common import partial_tag_length, split_trailing_space

OPEN, CLOSE = "<think>", "</think>"
_OPENING, _REASONING, _CONTENT_START, _CONTENT = range(4)


class ThinkReasoningParser(ReasoningParser):
    """Splits ``<think>...</think>`` reasoning from content, whole or streamed."""

    #: Whether a response starts inside reasoning when the prompt is unknown.
    starts_in_reasoning = False
    reasoning_end = CLOSE

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._state = _OPENING
        self._buffer = ""
        self._reasoning_started = False

    def _initially_reasoning(self) -> bool:
        prompt = self.context.prompt
        if prompt:
            return prompt.rfind(OPEN) > prompt.rfind(CLOSE)
        return self.starts_in_reasoning

    def _thinking_disabled(self) -> bool:
        return self.context.chat_template_kwargs.get("enable_thinking", True) is False

    def constraint_waits(self) -> bool:
        return not self._thinking_disabled() and super().constraint_waits()

    def split(self, text: str) -> tuple[str | None, str]:
        if self._thinking_disabled():
            return None, text
        rest = text.lstrip()
        if rest.startswith(OPEN):
            rest = rest[len(OPEN):]
        elif not self._initially_reasoning():
            return None, text
        reasoning, found, content = rest.partition(CLOSE)
        return reasoning.strip(), content.lstrip() if found else ""

    def feed(self, delta: str) -> ReasoningDelta:
        if self._thinking_disabled():
            return ReasoningDelta(content=delta)
        self._buffer += delta
        reasoning, content = [], []
        while self._step(reasoning, content):
            pass
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Consume what the buffer allows; True when the state changed and the buffer needs another look."""
        if self._state == _OPENING:
            return self._opening(content)
        if self._state == _REASONING:
            return self._reasoning(reasoning)
        text, self._buffer = self._buffer, ""
        if self._state == _CONTENT_START:
            text = text.lstrip()
            if text:
                self._state = _CONTENT
        content.append(text)
        return False

    def _opening(self, content: list[str]) -> bool:
        rest = self._buffer.lstrip()
        if rest.startswith(OPEN):
            self._state, self._buffer = _REASONING, rest[len(OPEN):]
            return True
        if OPEN.startswith(rest):  # all whitespace or a partial tag so far: wait
            return False
        if self._initially_reasoning():
            self._state = _REASONING
            return True
        self._state = _CONTENT
        content.append(self._buffer)
        self._buffer = ""
        return False

    def _reasoning(self, reasoning: list[str]) -> bool:
        before, found, after = self._buffer.partition(CLOSE)
        if found:
            self._emit_reasoning(before.rstrip(), reasoning)
            self._state, self._buffer = _CONTENT_START, after
            return True
        # Hold back a possible partial "</think>" and trailing whitespace (stripped if the tag follows).
        held = partial_tag_length(self._buffer, CLOSE)
        ready, space = split_trailing_space(self._buffer[:len(self._buffer) - held])
        self._emit_reasoning(ready, reasoning)
        self._buffer = space + self._buffer[len(self._buffer) - held:]
        return False

    def _emit_reasoning(self, text: str, out: list[str]) -> None:
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        out.append(text)

    def flush(self) -> ReasoningDelta:
        text, self._buffer = self._buffer, ""
        if self._thinking_disabled() or not text:
            return ReasoningDelta()
        if self._state == _OPENING:
            if not self._initially_reasoning():
                return ReasoningDelta(content=text)
            self._state = _REASONING
        if self._state == _REASONING:
            out: list[str] = []
            self._emit_reasoning(text.rstrip(), out)
            return ReasoningDelta(reasoning="".join(out))
        return ReasoningDelta(content=text.lstrip() if self._state == _CONTENT_START else text)


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1 and its distills: the template opens ``<think>`` in the prompt; the model always thinks."""

    starts_in_reasoning = True


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3 / QwQ: the model writes ``<think>`` itself; ``enable_thinking=False`` turns reasoning off."""


class PromptThinkReasoningParser(ThinkReasoningParser):
    """For templates that ignore ``enable_thinking`` (Nemotron Nano 2 reads "/think" and "/no_think" in the
    messages; LFM2.5 and MiniMax-M1 read nothing): a known prompt decides where the response starts, not the
    request's kwargs. Nemotron 3 Nano's template does read it, and then closes ``<think>`` in the prompt."""

    def _thinking_disabled(self) -> bool:
        return not self.context.prompt and super()._thinking_disabled()
