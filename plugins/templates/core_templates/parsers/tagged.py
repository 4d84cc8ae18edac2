"""The shared machinery of tool-call formats that wrap calls in a start tag and an optional end tag.

Content outside the blocks passes through; whitespace that only separates content from a parsed block is
dropped. A block that does not parse is kept, verbatim, as content. Streaming holds back a possible
partial start tag and trailing whitespace, and emits a block's calls once the block is complete, so it
gives exactly the whole-text result however the text is cut.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from core.parsers import ParsedToolCalls, Tool, ToolCall, ToolCallDelta, ToolCallFragment, ToolCallParser
from core.parsers import new_tool_call_id as _new_id
from core_templates.parsers.common import partial_tag_length, split_trailing_space

Call = tuple[str, str]  # (name, arguments JSON)


class TaggedToolCallParser(ToolCallParser):
    """Tool calls inside ``start_tag ... end_tag`` blocks; ``end_tag = ""`` means the block runs to the end.
    ``bare_start``: a block may also open without ``start_tag``, with this text at the very start of the
    response (after whitespace), which is then part of its body (Llama 3's ``{``, a pythonic ``[``)."""

    start_tag: str = ""
    end_tag: str = ""
    bare_start: str = ""

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._buffer = ""
        self._inside = False
        self._block_prefix = ""  # the text that opened the current block, kept in case it does not parse
        self._held_space = ""  # trailing whitespace not yet known to be content
        self._after_block = False  # strip the whitespace that follows a parsed block
        self._calls = 0
        self._at_start = True  # nothing but whitespace streamed yet: a bare_start may still open a block

    @abstractmethod
    def parse_block(self, body: str, tools: Sequence[Tool] | None) -> list[Call] | None:
        """The calls written in one block's body, or None when it is malformed."""

    def new_tool_call_id(self) -> str:
        """An id for the next call (a model family may require a particular shape)."""
        return _new_id()

    # -- whole text ------------------------------------------------------------------------------------

    def parse(self, text: str, tools: Sequence[Tool] | None = None) -> ParsedToolCalls:
        tools = self.context.tools if tools is None else tools
        content: list[str] = []
        calls: list[ToolCall] = []
        pos, after_block = 0, False
        while (start := self._find_start(text, pos, not content and not calls)) is not None:
            segment = text[pos:start[0]].lstrip() if after_block else text[pos:start[0]]
            ready, space = split_trailing_space(segment)
            content.append(ready)
            body, end = self._block_body(text, start[1])
            parsed = self.parse_block(body, tools)
            if parsed is None:
                content.append(space + text[start[0]:end])
            else:
                calls += [ToolCall(self.new_tool_call_id(), name, args) for name, args in parsed]
            pos, after_block = end, parsed is not None
        content.append(text[pos:].lstrip() if after_block else text[pos:])
        return ParsedToolCalls("".join(content), tuple(calls))

    def _find_start(self, text: str, pos: int, at_start: bool) -> tuple[int, int] | None:
        """(where the next block's opening starts, where its body starts), or None."""
        rest = text[pos:].lstrip()
        if at_start and self.bare_start and rest.startswith(self.bare_start):
            return pos, len(text) - len(rest)
        index = text.find(self.start_tag, pos)
        return None if index < 0 else (index, index + len(self.start_tag))

    def _block_body(self, text: str, body_start: int) -> tuple[str, int]:
        end = text.find(self.end_tag, body_start) if self.end_tag else -1
        if end < 0:
            return text[body_start:], len(text)
        return text[body_start:end], end + len(self.end_tag)

    # -- streaming -------------------------------------------------------------------------------------

    def feed(self, delta: str) -> ToolCallDelta:
        self._buffer += delta
        content: list[str] = []
        fragments: list[ToolCallFragment] = []
        while self._inside_step(content, fragments) if self._inside else self._outside_step(content):
            pass
        return ToolCallDelta("".join(content), tuple(fragments))

    def flush(self) -> ToolCallDelta:
        content: list[str] = []
        fragments: list[ToolCallFragment] = []
        if self._inside:
            self._close_block(self._buffer, self._buffer, content, fragments)
        else:
            self._emit(self._buffer, content)
            content.append(self._held_space)
        self._buffer = self._held_space = ""
        return ToolCallDelta("".join(content), tuple(fragments))

    def _outside_step(self, content: list[str]) -> bool:
        start = self._stream_start(self._buffer)
        if start is not None:
            self._emit(self._buffer[:start[0]], content)
            self._block_prefix = self._buffer[start[0]:start[1]]
            self._buffer, self._inside = self._buffer[start[1]:], True
            return True
        held = self._stream_hold(self._buffer)
        self._emit(self._buffer[:len(self._buffer) - held], content)
        self._buffer = self._buffer[len(self._buffer) - held:]
        return False

    def _stream_start(self, buffer: str) -> tuple[int, int] | None:
        """Where a block opens in the undecided buffer."""
        at_start = self._at_start and bool(self.bare_start)
        self._at_start = self._at_start and not buffer.strip()  # leading whitespace keeps the start open
        return self._find_start(buffer, 0, at_start)

    def _stream_hold(self, buffer: str) -> int:
        """How much of the buffer's end may still become an opening."""
        return partial_tag_length(buffer, self.start_tag)

    def _inside_step(self, content: list[str], fragments: list[ToolCallFragment]) -> bool:
        end = self._buffer.find(self.end_tag) if self.end_tag else -1
        if end < 0:
            return False
        body, rest = self._buffer[:end], self._buffer[end + len(self.end_tag):]
        self._close_block(body, body + self.end_tag, content, fragments)
        self._buffer = rest
        return True

    def _close_block(self, body: str, raw: str, content: list[str], fragments: list[ToolCallFragment]) -> None:
        parsed = self.parse_block(body, self.context.tools)
        if parsed is None:
            content.append(self._held_space + self._block_prefix + raw)
        for name, arguments in parsed or ():
            fragments.append(ToolCallFragment(self._calls, self.new_tool_call_id(), name, arguments))
            self._calls += 1
        self._inside, self._held_space, self._after_block = False, "", parsed is not None

    def _emit(self, text: str, content: list[str]) -> None:
        """Emit content, holding trailing whitespace (it is dropped if a parsed block follows)."""
        text = self._held_space + text
        if self._after_block:
            text = text.lstrip()
            if not text:
                return
        ready, self._held_space = split_trailing_space(text)
        if ready:
            content.append(ready)
            self._after_block = False
