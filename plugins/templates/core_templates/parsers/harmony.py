"""gpt-oss's Harmony format: reasoning, content and tool calls as messages on channels.

    <|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

A message is ``<|start|>HEADER<|message|>BODY``, ended by ``<|end|>``, ``<|call|>`` or ``<|return|>`` (the
last two are stop tokens, which the server drops), by the next ``<|start|>`` or by the end of the text.
The prompt ends with ``<|start|>assistant``, so a response opens inside the first header: it starts with
``<|channel|>`` or `` to=``. The header names a channel and, in its role part or after the channel, a
recipient ``to=NAME``:

* ``analysis`` -> reasoning, as are messages to built-in tools (``browser.search``, ``python``);
* ``final``, and ``commentary`` without a recipient (a preamble meant for the user) -> content;
* a recipient ``functions.NAME`` on any channel -> a call of NAME whose arguments are the JSON body.

The markers are special tokens: the parsers see them only where the server decodes the response with
``skip_special_tokens=False`` (`reads_special_tokens`); a response without them is plain content. The
reasoning parser hands calls on as content, as written, to the tool-call parser ("openai"), which also
reads a whole Harmony response when it runs alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from core.parsers import (
    ParsedToolCalls,
    ReasoningDelta,
    ReasoningParser,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolCallFragment,
    ToolCallParser,
    new_tool_call_id,
)
from core_templates.parsers.common import arguments_json, partial_tag_length

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
CALL = "<|call|>"
ENDS = ("<|end|>", CALL, "<|return|>")
FUNCTIONS = "functions."
_OPENINGS = (CHANNEL, " to=")  # how a response that continues the prompt's "<|start|>assistant" begins
_CHANNEL_NAME = re.compile(r"[^\s<]*")
_OUTSIDE, _HEADER, _BODY = range(3)


@dataclass(frozen=True)
class Header:
    """What a message's header says: its channel and its recipient (None when it names none)."""

    channel: str | None
    recipient: str | None

    @property
    def function(self) -> str | None:
        """The function the message calls (recipient ``functions.NAME``; "" when NAME is missing), or None."""
        recipient = self.recipient or ""
        return recipient[len(FUNCTIONS):] if recipient.startswith(FUNCTIONS) else None


def parse_header(text: str) -> Header:
    """The channel and recipient of header `text` (without ``<|start|>`` and ``<|message|>``)."""
    channel = None
    if (index := text.find(CHANNEL)) >= 0:
        rest = text[index + len(CHANNEL):]
        channel = _CHANNEL_NAME.match(rest)[0]  # type: ignore[index]
        text = f"{text[:index]} {rest[len(channel):]}"
    words = text.replace(CONSTRAIN, " " + CONSTRAIN).split()
    recipient = next((word[3:] for word in words if word.startswith("to=")), None)
    return Header(channel or None, recipient or None)


class Event(NamedTuple):
    """A piece of Harmony text: ``header`` (`text` is the header as written, through ``<|message|>``),
    ``body`` text, ``end`` of a message (`text` is its end marker, "" when none), ``outside`` text, or a
    ``broken`` header that never reached ``<|message|>``."""

    kind: Literal["header", "body", "end", "outside", "broken"]
    text: str
    header: Header | None = None


class HarmonyScanner:
    """Splits Harmony text into events, whole or streamed: the same events (adjacent texts joined)
    however the text is cut, since a possible partial marker is held back."""

    def __init__(self) -> None:
        self._state, self._buffer = _OUTSIDE, ""
        self._opener = ""  # what opened the current header: "<|start|>", or "" for the response's own start
        self._fresh = True  # nothing read yet: an opening here continues the prompt's header

    def feed(self, text: str) -> list[Event]:
        """The events that `text` completes."""
        self._buffer += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def flush(self) -> list[Event]:
        """The rest, once the text has ended: a header still open is broken, a body still open ends."""
        events = self.feed("")
        buffer, self._buffer, state, self._state = self._buffer, "", self._state, _OUTSIDE
        if state == _HEADER:
            events.append(Event("broken", self._opener + buffer))
        elif state == _BODY:
            _add(events, "body", buffer)
            events.append(Event("end", ""))
        else:
            _add(events, "outside", buffer)
        return events

    def _step(self, events: list[Event]) -> bool:
        if self._state == _HEADER:
            return self._header(events)
        if self._state == _BODY:
            return self._body(events)
        return self._outside(events)

    def _outside(self, events: list[Event]) -> bool:
        if self._fresh:
            if any(opening.startswith(self._buffer) for opening in _OPENINGS):
                return False  # too short to tell yet
            self._fresh = False
            if self._buffer.startswith(_OPENINGS):
                self._state, self._opener = _HEADER, ""
                return True
        index = self._buffer.find(START)
        if index >= 0:
            _add(events, "outside", self._buffer[:index])
            self._state, self._opener, self._buffer = _HEADER, START, self._buffer[index + len(START):]
            return True
        self._emit_held(events, "outside", START)
        return False

    def _header(self, events: list[Event]) -> bool:
        found = _first(self._buffer, (MESSAGE, START, *ENDS))
        if found is None:
            return False
        index, marker = found
        text, self._buffer = self._buffer[:index], self._buffer[index + len(marker):]
        if marker == MESSAGE:
            events.append(Event("header", self._opener + text + MESSAGE, parse_header(text)))
            self._state = _BODY
        elif marker == START:  # a new message cut this header off
            events.append(Event("broken", self._opener + text))
            self._opener = START
        else:
            events.append(Event("broken", self._opener + text + marker))
            self._state = _OUTSIDE
        return True

    def _body(self, events: list[Event]) -> bool:
        found = _first(self._buffer, (START, *ENDS))
        if found is None:
            self._emit_held(events, "body", START, *ENDS)
            return False
        index, marker = found
        _add(events, "body", self._buffer[:index])
        self._buffer = self._buffer[index + len(marker):]
        events.append(Event("end", "" if marker == START else marker))
        self._state, self._opener = (_HEADER, START) if marker == START else (_OUTSIDE, "")
        return True

    def _emit_held(self, events: list[Event], kind: Literal["body", "outside"], *markers: str) -> None:
        ready = len(self._buffer) - partial_tag_length(self._buffer, *markers)
        _add(events, kind, self._buffer[:ready])
        self._buffer = self._buffer[ready:]


def _add(events: list[Event], kind: Literal["body", "outside"], text: str) -> None:
    if text:
        events.append(Event(kind, text))


def _first(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """(index, marker) of the earliest marker in `text`, or None."""
    found = [(index, marker) for marker in markers if (index := text.find(marker)) >= 0]
    return min(found) if found else None


_Kind = Literal["reasoning", "content", "call"]


def _kind(header: Header) -> _Kind:
    if header.function is not None:
        return "call"
    return "reasoning" if header.channel == "analysis" or header.recipient else "content"


class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss (``openai_gptoss``): analysis messages are reasoning, final messages and preambles content,
    and calls are passed on as content for the tool-call parser. Messages of one kind are joined by "\\n"."""

    reasoning_end = CHANNEL + "final" + MESSAGE
    #: The markers are special tokens (see the module's docstring).
    reads_special_tokens = True

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._scanner = HarmonyScanner()
        self._kind: _Kind = "content"  # where the current message's body goes
        self._messages = {"reasoning": 0, "content": 0}

    def split(self, text: str) -> tuple[str | None, str]:
        parser = type(self)(self.tokenizer).start(self.context)
        deltas = (parser.feed(text), parser.flush())
        reasoning = "".join(d.reasoning for d in deltas)
        return reasoning if parser._messages["reasoning"] else None, "".join(d.content for d in deltas)

    def feed(self, delta: str) -> ReasoningDelta:
        return self._route(self._scanner.feed(delta))

    def flush(self) -> ReasoningDelta:
        return self._route(self._scanner.flush())

    def _route(self, events: list[Event]) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        for event in events:
            if event.kind == "header":
                self._kind = _kind(event.header)  # type: ignore[arg-type]
                text = event.text if self._kind == "call" else self._separator()
            elif event.kind == "end":
                # A call needs its end even where a new message cut it off: the tool-call parser reads it.
                text = (event.text or CALL) if self._kind == "call" else ""
            else:
                text = event.text
            (reasoning if self._kind == "reasoning" else content).append(text)
            if event.kind == "end":
                self._kind = "content"
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _separator(self) -> str:
        self._messages[self._kind] += 1
        return "\n" if self._messages[self._kind] > 1 else ""


class HarmonyToolCallParser(ToolCallParser):
    """gpt-oss (``openai``): a message to ``functions.NAME`` is a call of NAME; its body, a JSON object (or
    nothing), is the arguments. Every other text passes through as content, as does a call whose body is
    not a JSON object. A call is emitted whole once its message ends."""

    reads_special_tokens = True

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._scanner = HarmonyScanner()
        self._call: list[str] | None = None  # the current call's message as written: header, body pieces
        self._name = ""
        self._calls = 0

    def parse(self, text: str, tools: Sequence[Tool] | None = None) -> ParsedToolCalls:
        parser = type(self)(self.tokenizer).start(self.context)
        deltas = (parser.feed(text), parser.flush())
        calls = [ToolCall(f.id or "", f.name or "", f.arguments) for d in deltas for f in d.tool_calls]
        return ParsedToolCalls("".join(d.content for d in deltas), tuple(calls))

    def feed(self, delta: str) -> ToolCallDelta:
        return self._route(self._scanner.feed(delta))

    def flush(self) -> ToolCallDelta:
        return self._route(self._scanner.flush())

    def _route(self, events: list[Event]) -> ToolCallDelta:
        content: list[str] = []
        calls: list[ToolCallFragment] = []
        for event in events:
            if event.kind == "header" and event.header and event.header.function:
                self._name, self._call = event.header.function, [event.text]
            elif self._call is not None and event.kind in ("body", "end"):
                self._call.append(event.text)
                if event.kind == "end":
                    self._close(content, calls)
            else:
                content.append(event.text)
        return ToolCallDelta("".join(content), tuple(calls))

    def _close(self, content: list[str], calls: list[ToolCallFragment]) -> None:
        written, self._call = self._call or [], None
        body = "".join(written[1:-1])
        arguments = "{}" if not body.strip() else arguments_json(body)
        if arguments is None:
            content.append("".join(written))
            return
        calls.append(ToolCallFragment(self._calls, new_tool_call_id(), self._name, arguments))
        self._calls += 1
