"""The one seam where a chat response's text is post-processed: reasoning and tool-call parsing.

`Postprocessors.choose` picks the parsers once, at start-up: the ones `core serve --reasoning-parser /
--tool-call-parser` name, else the ones registered for the model's architecture and chat template (see
core.resolve.automatic_entry); "none" turns either off. Per request, `for_request` makes a
ChatPostprocessor that keeps one pair of parsers per choice: text goes through the reasoning parser first
and only its content reaches the tool-call parser, which runs only for requests that send tools. The routes
call `final` on a whole response or `delta` on each streamed piece, and map the protocol-neutral result
(ChatMessageParts, StreamPiece) onto their wire format. Nothing else in the server looks at the text.

A parser that raises (a bug, never malformed model output, which parsers return as content) is logged and
its choice falls back to plain text, so a response never fails because of parsing.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from core.forced_tool_call import ForcedCallParser, ForcedToolCall
from core.parsers import (
    ParseContext,
    ReasoningDelta,
    ReasoningParser,
    ToolCall,
    ToolCallDelta,
    ToolCallFormat,
    ToolCallParser,
)
from core.resolve import parser_entry

if TYPE_CHECKING:
    from core.engine import AsyncEngine
    from core.plugins import PluginHost
    from core.registry import Entry
    from core.request import PreparedRequest

log = logging.getLogger(__name__)
PieceKind = Literal["reasoning", "content", "tool_call", "arguments"]


@dataclass
class ChatMessageParts:
    """What a whole response's text splits into."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class StreamPiece:
    """One piece of a streamed response, in order: reasoning or content text, the start of tool call
    `index` (with `id` and `name`), or a piece of that call's `arguments` JSON text."""

    kind: PieceKind
    text: str = ""
    index: int = 0
    id: str | None = None
    name: str | None = None


class _ChoiceParsers:
    """The parsers of one choice of one response (parsers keep state, so one pair per choice)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None,
                 parallel_calls: bool = True) -> None:
        self.reasoning, self.tools, self.parallel_calls = reasoning, tools, parallel_calls
        self.called_tools = False
        self.broken = False

    def feed(self, text: str, finished: bool) -> list[StreamPiece]:
        split = self.reasoning.feed(text) if self.reasoning else ReasoningDelta(content=text)
        if finished and self.reasoning:
            rest = self.reasoning.flush()
            split = ReasoningDelta(split.reasoning + rest.reasoning, split.content + rest.content)
        pieces = [StreamPiece("reasoning", split.reasoning)] if split.reasoning else []
        if self.tools is None:
            return pieces + ([StreamPiece("content", split.content)] if split.content else [])
        for delta in (self.tools.feed(split.content), self.tools.flush() if finished else ToolCallDelta()):
            pieces += self._tool_pieces(delta)
        return pieces

    def _tool_pieces(self, delta: ToolCallDelta) -> list[StreamPiece]:
        pieces = [StreamPiece("content", delta.content)] if delta.content else []
        for fragment in delta.tool_calls:
            if fragment.index > 0 and not self.parallel_calls:
                continue
            if fragment.name is not None:
                self.called_tools = True
                pieces.append(StreamPiece("tool_call", index=fragment.index, id=fragment.id, name=fragment.name))
            if fragment.arguments:
                pieces.append(StreamPiece("arguments", fragment.arguments, index=fragment.index))
        return pieces


class ChatPostprocessor:
    """Splits the responses of one request; without parsers every text is plain content.

    :param reasoning: makes a started reasoning parser (one per choice), or None.
    :param tools: makes a started tool-call parser (one per choice), or None.
    :param parallel_calls: False keeps a response's first tool call only (OpenAI's parallel_tool_calls,
        Anthropic's disable_parallel_tool_use), as vLLM does: the model may have written more.
    """

    def __init__(self, reasoning: Callable[[], ReasoningParser] | None = None,
                 tools: Callable[[], ToolCallParser] | None = None, parallel_calls: bool = True) -> None:
        self._reasoning, self._tools, self._parallel_calls = reasoning, tools, parallel_calls
        self._choices: dict[int, _ChoiceParsers] = {}

    @property
    def is_plain(self) -> bool:
        """Whether every text is plain content (no parser is used for this request)."""
        return self._reasoning is None and self._tools is None

    def final(self, text: str) -> ChatMessageParts:
        """Split a whole response."""
        try:
            reasoning, content = self._reasoning().split(text) if self._reasoning else (None, text)
            parsed = self._tools().parse(content) if self._tools else None
        except Exception:
            log.exception("a response parser failed; the response is returned as plain content")
            return ChatMessageParts(content=text)
        if parsed is None or not parsed.tool_calls:
            return ChatMessageParts(content, reasoning)
        calls = list(parsed.tool_calls) if self._parallel_calls else list(parsed.tool_calls[:1])
        return ChatMessageParts(parsed.content or None, reasoning, calls)

    def delta(self, choice: int, text: str, finished: bool = False) -> list[StreamPiece]:
        """The pieces that the next streamed text of choice `choice` completes; `finished` on its last text
        releases whatever the parsers held back."""
        parsers = self._choices.get(choice)
        if parsers is None:
            parsers = self._choices[choice] = self._new_choice()
        if not parsers.broken:
            try:
                return parsers.feed(text, finished)
            except Exception:
                log.exception("a response parser failed; the rest of this response is plain content")
                parsers.broken = True
        return [StreamPiece("content", text)] if text else []

    def called_tools(self, choice: int) -> bool:
        """Whether streamed choice `choice` has produced a tool call (its finish reason is then tool_calls)."""
        parsers = self._choices.get(choice)
        return parsers is not None and parsers.called_tools

    def _new_choice(self) -> _ChoiceParsers:
        try:
            return _ChoiceParsers(self._reasoning() if self._reasoning else None,
                                  self._tools() if self._tools else None, self._parallel_calls)
        except Exception:
            log.exception("a response parser could not be created; this response is plain content")
            parsers = _ChoiceParsers(None, None)
            parsers.broken = True
            return parsers


@dataclass(frozen=True)
class Postprocessors:
    """The parsers chosen for a server, and the factory of each request's ChatPostprocessor.

    :param reasoning: ``factory(tokenizer) -> ReasoningParser``, or None.
    :param tools: ``factory(tokenizer) -> ToolCallParser``, or None.
    """

    reasoning: Callable[[Any], ReasoningParser] | None = None
    tools: Callable[[Any], ToolCallParser] | None = None
    tokenizer: Any = None

    @classmethod
    def choose(cls, plugins: PluginHost, engine: AsyncEngine, reasoning_parser: str | None = None,
               tool_call_parser: str | None = None) -> Postprocessors:
        """Load the named parsers, or the automatic choice for the engine's model; unknown names fail here."""
        architecture, template = engine.model_info.architecture, engine.chat_template
        source = (template.source if template is not None else None) or engine.model_info.chat_template
        reasoning = parser_entry(plugins.reasoning_parsers, reasoning_parser, "--reasoning-parser", architecture,
                                 source)
        tools = parser_entry(plugins.tool_call_parsers, tool_call_parser, "--tool-call-parser", architecture,
                             source)
        for entry, named in ((reasoning, reasoning_parser), (tools, tool_call_parser)):
            if entry is not None:
                how = "as named" if named else f"automatically for {architecture}"
                log.info("%s %r from plugin %r, chosen %s", entry.kind, entry.name, entry.plugin, how)
        return cls(_load(reasoning), _load(tools), engine.tokenizer)

    @functools.cached_property
    def tool_call_format(self) -> ToolCallFormat | None:
        """How the tool-call parser reads one call (a forced tool_choice is generated in it), or None where
        the server has no parser or one whose calls are not JSON (a forced call is then a bare JSON object
        that `ForcedCallParser` reads: core.forced_tool_call)."""
        return None if self.tools is None else self.tools(self.tokenizer).call_format

    def prepare(self, prepared: PreparedRequest) -> PreparedRequest:
        """`prepared` as its chat response's parsers need it: decoded with special tokens where a parser
        reads them (`reads_special_tokens`; the tool-call parser counts only for requests that send tools),
        and its constraint applied after the reasoning section (`gate_constraint`)."""
        parsers = (self.reasoning, self.tools if prepared.tools else None)
        if prepared.config.skip_special_tokens and any(
                parser is not None and parser(self.tokenizer).reads_special_tokens for parser in parsers):
            config = dataclasses.replace(prepared.config, skip_special_tokens=False)
            prepared = dataclasses.replace(prepared, config=config)
        return self.gate_constraint(prepared)

    def gate_constraint(self, prepared: PreparedRequest) -> PreparedRequest:
        """`prepared` with its constraint applied only after the reasoning section, when the reasoning parser
        says the response starts with one (`ReasoningParser.constraint_waits`): the constraint starts once
        the output has generated the parser's `reasoning_end` (as the tokenizer's ids), as vLLM does."""
        if prepared.constraint is None or self.reasoning is None or self.tokenizer is None:
            return prepared
        context = ParseContext(prepared.prompt_text, prepared.tools, dict(prepared.chat_template_kwargs))
        parser = self.reasoning(self.tokenizer).start(context)
        if not parser.constraint_waits() or not parser.reasoning_end:
            return prepared
        marker = self.tokenizer.encode(parser.reasoning_end, add_special_tokens=False)
        return dataclasses.replace(prepared, constraint=prepared.constraint.after(marker))

    def for_prepared(self, prepared: PreparedRequest, parallel_calls: bool = True) -> ChatPostprocessor:
        """The postprocessor of a prepared request: its prompt as rendered, its tools and template switches,
        whether its output is a forced tool call, and whether it keeps more than one call."""
        forced = isinstance(prepared.config.structured_output, ForcedToolCall)
        return self.for_request(prepared.prompt_text, prepared.tools, prepared.chat_template_kwargs, forced,
                                parallel_calls)

    def for_request(self, prompt: str, tools: Sequence[Mapping[str, Any]] | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None,
                    forced_call: bool = False, parallel_calls: bool = True) -> ChatPostprocessor:
        """The postprocessor of one request whose rendered prompt is `prompt`; tool calls are parsed only
        when the request sends tools. `forced_call`: the output was generated as one call in
        `tool_call_format`, which `ForcedCallParser` reads where that is the bare JSON object.
        `parallel_calls` False: only the first call is kept (ChatPostprocessor)."""
        tool_parser = self.tools
        if forced_call and self.tool_call_format is None:
            tool_parser = ForcedCallParser
        if self.reasoning is None and (tool_parser is None or not tools):
            return ChatPostprocessor()
        context = ParseContext(prompt if self.reasoning else "", tools, dict(chat_template_kwargs or {}))
        reasoning, tool_calls = self.reasoning, tool_parser if tools else None
        return ChatPostprocessor(
            (lambda: reasoning(self.tokenizer).start(context)) if reasoning else None,
            (lambda: tool_calls(self.tokenizer).start(context)) if tool_calls else None, parallel_calls,
        )


def _load(entry: Entry | None) -> Any:
    return None if entry is None else entry.load()
