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

Which parser a server uses is core.resolve's question (`parser_entry`): the name given, none for "none",
or the automatic choice by the model's architecture and chat template.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

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


class _ResponseParser:
    """State every parser shares: the tokenizer and the request context.

    ``reads_special_tokens``: the format's markers are special tokens of the tokenizer (gpt-oss's Harmony:
    ``<|channel|>``, ``<|message|>``, ...), so the server decodes the responses that this parser reads with
    ``skip_special_tokens=False``, whatever the request asked (as vLLM's tool parsers' ``adjust_request``).
    """

    reads_special_tokens: bool = False

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.context = ParseContext()

    def start(self: _Parser, context: ParseContext) -> _Parser:
        """Give the parser the request it parses; call before the first feed. Returns self."""
        self.context = context
        return self


class ReasoningParser(_ResponseParser, ABC):
    """Splits one response into reasoning (e.g. between ``<think>`` tags) and content.

    ``reasoning_end`` is the text that closes the reasoning section (None: the parser cannot say), so
    that a structured-output constraint applies only to what follows it (`constraint_waits`).
    """

    reasoning_end: str | None = None

    def constraint_waits(self) -> bool:
        """After `start`: whether a constraint on this response waits for `reasoning_end` to be generated.
        False (the constraint applies from the first token) without a `reasoning_end`, or when the prompt
        already closed the reasoning section (it ends with `reasoning_end`, e.g. a template that writes an
        empty ``<think></think>`` when thinking is off)."""
        end = self.reasoning_end
        return bool(end) and not self.context.prompt.rstrip().endswith(end)

    @abstractmethod
    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole response; reasoning is None when it has none."""

    @abstractmethod
    def feed(self, delta: str) -> ReasoningDelta:
        """The reasoning and content that `delta` completes; text that may be half a tag is held back."""

    @abstractmethod
    def flush(self) -> ReasoningDelta:
        """Whatever is still held back, once the response has ended."""


@dataclass(frozen=True)
class ToolCallFormat:
    """How a parser reads one call, so that a forced call (tool_choice "required" or a named function)
    can be generated under a constraint: the text `begin`, a JSON object ``{"name": ..., ARGUMENTS_KEY:
    {...}}``, then the text `end`."""

    begin: str = ""
    end: str = ""
    arguments_key: str = "arguments"


class ToolCallParser(_ResponseParser, ABC):
    """Finds tool calls in one response (after reasoning was split off).

    ``call_format`` says how one call is written (None: a format no JSON constraint can produce; a forced
    tool call is then generated as a bare JSON object and read by core.forced_tool_call instead).
    """

    call_format: ToolCallFormat | None = None

    @abstractmethod
    def parse(self, text: str, tools: Sequence[Tool] | None = None) -> ParsedToolCalls:
        """Content and tool calls of a whole response; `tools` defaults to the context's tools."""

    @abstractmethod
    def feed(self, delta: str) -> ToolCallDelta:
        """The content and tool-call fragments that `delta` completes."""

    @abstractmethod
    def flush(self) -> ToolCallDelta:
        """Whatever is still held back, once the response has ended."""
