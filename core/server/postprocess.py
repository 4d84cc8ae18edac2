"""The one seam where a chat response's text is post-processed (reasoning and tool-call parsing).

Today every response passes through unchanged. The parsers (core/parsers.py: ReasoningParser,
ToolCallParser, registered through `core_register_reasoning_parsers` / `core_register_tool_call_parsers`)
plug in here: `make_postprocessor` builds one ChatPostprocessor per request from the names given to
`core serve --reasoning-parser/--tool-call-parser`, and the chat routes call `final` on a whole
response or `delta` on each streamed piece. Nothing else in the server looks at the text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core.errors import UnsupportedError


@dataclass
class ChatMessageParts:
    """What a chat message's text splits into."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def as_message(self) -> dict[str, Any]:
        """The assistant message of a non-streamed response."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message

    def as_delta(self) -> dict[str, Any]:
        """The `delta` of a streamed chunk (only the parts present)."""
        delta: dict[str, Any] = {}
        if self.content:
            delta["content"] = self.content
        if self.reasoning_content:
            delta["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            delta["tool_calls"] = self.tool_calls
        return delta


class ChatPostprocessor:
    """Pass-through: the whole text is content. Parser-backed subclasses override both methods."""

    def final(self, text: str) -> ChatMessageParts:
        """Split a whole response."""
        return ChatMessageParts(content=text)

    def delta(self, choice: int, text: str) -> ChatMessageParts:
        """Split the next streamed piece of choice `choice` (a parser keeps state per choice)."""
        return ChatMessageParts(content=text)


PostprocessorFactory = Callable[[], ChatPostprocessor]


def make_postprocessor_factory(reasoning_parser: str | None, tool_call_parser: str | None) -> PostprocessorFactory:
    """A factory of per-request postprocessors; parsers are not wired yet, so naming one fails loudly."""
    for flag, name in (("--reasoning-parser", reasoning_parser), ("--tool-call-parser", tool_call_parser)):
        if name:
            raise UnsupportedError(f"{flag} {name!r}: reasoning and tool-call parsing is not wired into the "
                                   "server yet")
    return ChatPostprocessor
