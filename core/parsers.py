"""Contracts for parsers that turn a model's text into reasoning, content and tool calls.

Plugins register factories through ``core_register_reasoning_parsers`` and
``core_register_tool_call_parsers``; ``factory(tokenizer)`` (the tokenizer may be None) returns a parser for
ONE response. The server then calls ``parser.start(ParseContext(...))`` with what it knows about the
request, and either parses the whole text at once (``split`` / ``parse``) or streams it: ``feed(delta)``
for every new piece of text and ``flush()`` once at the end. Streaming and whole-text parsing give the
same result however the text is cut into deltas.

When both parsers are used, text goes through the reasoning parser first and only its ``content`` reaches
the tool-call parser. The deltas map onto the wire formats without further parsing:

* OpenAI chat completions: ``ReasoningDelta.reasoning`` -> ``delta.reasoning_content``;
  a ``ToolCallFragment`` with ``id``/``name`` -> a ``delta.tool_calls`` entry that starts call ``index``;
  later fragments of that index carry only ``function.arguments`` pieces.
* Anthropic messages: reasoning -> a ``thinking`` content block; a fragment with ``id``/``name`` ->
  ``content_block_start`` of a ``tool_use`` block, its arguments -> ``input_json_delta`` events, and
  ``ToolCall.input()`` the block's ``input`` object in non-streaming responses.

Parsers never raise on malformed model output: what they cannot parse is returned as plain content.

`parser_entry` picks the parser a server uses: the name given, none for "none", or the automatic choice
by the model's architecture and chat template (`automatic_entry`).
"""

from __future__ import annotations

import json
import logging
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from core.errors import PluginError
from core.registry import Entry, Registry

log = logging.getLogger(__name__)
Tool = Mapping[str, Any]
_Parser = TypeVar("_Parser", bound="_ResponseParser")


@dataclass(frozen=True)
class ParseContext:
    """What a parser may know about the request whose response it parses.

    :param prompt: the rendered prompt text ("" when unknown); a template that opens a ``<think>`` block
        in the prompt makes the response start inside reasoning.
    :param tools: the request's tool definitions (OpenAI ``{"type": "function", "function": {...}}``).
    :param chat_template_kwargs: the request's chat_template_kwargs (e.g. ``enable_thinking``).
    """

    prompt: str = ""
    tools: Sequence[Tool] | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReasoningDelta:
    """New reasoning text and new content text from one streamed delta (either may be empty)."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


@dataclass(frozen=True)
class ToolCall:
    """One complete tool call; ``arguments`` is a JSON object as text (as OpenAI sends it)."""

    id: str
    name: str
    arguments: str

    def input(self) -> dict[str, Any]:
        """The arguments as an object (Anthropic's ``tool_use.input``); {} when they are not an object."""
        try:
            value = json.loads(self.arguments)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class ParsedToolCalls:
    """A whole response split into plain content and tool calls."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ToolCallFragment:
    """A streamed piece of tool call ``index``: its first fragment carries ``id`` and ``name``.

    Concatenating the ``arguments`` of every fragment with one index gives that call's arguments.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ToolCallDelta:
    """New plain content and tool-call fragments from one streamed delta."""

    content: str = ""
    tool_calls: tuple[ToolCallFragment, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def new_tool_call_id() -> str:
    """A fresh OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def collect_tool_calls(deltas: Sequence[ToolCallDelta]) -> ParsedToolCalls:
    """Join streamed deltas into the response they describe (tests, non-streaming fallbacks)."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, list[str]] = {}
    for fragment in (f for d in deltas for f in d.tool_calls):
        call = calls.setdefault(fragment.index, [fragment.id or "", fragment.name or "", ""])
        call[2] += fragment.arguments
    return ParsedToolCalls(content, tuple(ToolCall(*calls[i]) for i in sorted(calls)))


class _ResponseParser:
    """State every parser shares: the tokenizer and the request context."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.context = ParseContext()

    def start(self: _Parser, context: ParseContext) -> _Parser:
        """Give the parser the request it parses; call before the first feed. Returns self."""
        self.context = context
        return self


class ReasoningParser(_ResponseParser, ABC):
    """Splits one response into reasoning (e.g. between ``<think>`` tags) and content."""

    @abstractmethod
    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole response; reasoning is None when it has none."""

    @abstractmethod
    def feed(self, delta: str) -> ReasoningDelta:
        """The reasoning and content that `delta` completes; text that may be half a tag is held back."""

    @abstractmethod
    def flush(self) -> ReasoningDelta:
        """Whatever is still held back, once the response has ended."""


class ToolCallParser(_ResponseParser, ABC):
    """Finds tool calls in one response (after reasoning was split off)."""

    @abstractmethod
    def parse(self, text: str, tools: Sequence[Tool] | None = None) -> ParsedToolCalls:
        """Content and tool calls of a whole response; `tools` defaults to the context's tools."""

    @abstractmethod
    def feed(self, delta: str) -> ToolCallDelta:
        """The content and tool-call fragments that `delta` completes."""

    @abstractmethod
    def flush(self) -> ToolCallDelta:
        """Whatever is still held back, once the response has ended."""


# -- choosing a parser -------------------------------------------------------------------------------

#: The flag value that turns a parser off (no automatic choice either).
NO_PARSER = "none"


def parser_entry(registry: Registry, requested: str | None, flag: str, architecture: str,
                 template_source: str | None) -> Entry | None:
    """The registered parser to use: the one `requested` names, none for "none", else the automatic choice.

    :raises PluginError: when `requested` names no registered parser (the message lists the registered ones).
    """
    if requested == NO_PARSER:
        return None
    if requested:
        entry = registry.find(requested)
        if entry is None:
            known = ", ".join(registry.names()) or "none registered; install the templates plugin"
            raise PluginError(f"{flag} {requested!r} is not a registered {registry.kind}; choose one of: "
                              f"{known} (or {NO_PARSER!r} to turn it off)")
        return entry
    return automatic_entry(registry, architecture, template_source)


def automatic_entry(registry: Registry, architecture: str, template_source: str | None) -> Entry | None:
    """The one parser registered for `architecture` whose template markers all occur in the chat template.

    A registration's ``architectures`` option lists the model architectures it fits; its optional
    ``chat_template_contains`` lists text that must appear in the chat template (several model families
    share an architecture; the template tells them apart). No match, or more than one, means no parser:
    the choice is automatic only when it is unambiguous.
    """
    source = template_source or ""
    matches = [entry for entry in registry
               if architecture in entry.meta.get("architectures", ())
               and all(marker in source for marker in entry.meta.get("chat_template_contains", ()))]
    if len(matches) > 1:
        log.warning("several %ss fit %s (%s): none is chosen automatically; name one with a flag",
                    registry.kind, architecture, ", ".join(e.name for e in matches))
    return matches[0] if len(matches) == 1 else None
