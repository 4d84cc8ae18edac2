"""Streamed Responses output: parsed stream pieces become output item events, numbered in order.

Reasoning streams as a ``reasoning`` item (``response.reasoning_text.delta``), content as a ``message``
item with one ``output_text`` part (``response.output_text.delta``), and each tool call as a
``function_call`` item whose arguments arrive as ``response.function_call_arguments.delta`` pieces. An
item stays open while pieces of its kind keep coming; the next kind (or the next tool call) closes it
first, with its ``.done`` events. Every event carries the stream's next ``sequence_number``. Output logprobs
(when asked for) ride on the message's next ``response.output_text.delta`` (a token's text may be held back, or be
reasoning), and the message's ``.done`` events and part carry them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from core.server import responses_protocol as rp
from core.server.postprocess import StreamPiece

Event = dict[str, Any]


@dataclass
class _OpenItem:
    kind: str  # "message", "reasoning" or "function_call"
    id: str
    index: int
    text: str = ""
    call_id: str = ""
    name: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class ResponseEvents:
    """The events of one streamed response, from `response.created` to its last event."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []  # the finished output items, in order
        self._sequence = 0
        self._open: _OpenItem | None = None
        self._logprobs: list[dict[str, Any]] = []  # logprobs not yet sent on an output_text delta

    def event(self, kind: str, **payload: Any) -> Event:
        """One event of type `kind`, numbered."""
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **payload}

    def events(self, pieces: Sequence[StreamPiece], logprobs: Sequence[dict[str, Any]] = ()) -> list[Event]:
        """The events that `pieces` (in order) produce; `logprobs` are those of the tokens they came from."""
        self._logprobs += logprobs
        out: list[Event] = []
        for piece in pieces:
            kind = _item_kind(piece)
            if piece.kind == "tool_call" or self._open is None or self._open.kind != kind:
                out += self._close() + self._start(piece)
            if piece.kind != "tool_call":
                out.append(self._delta(piece.text))
        return out

    def finish(self, status: str = "completed") -> list[Event]:
        """Close the open item, as `rp.item_status(status)` of a response of `status`; a response that had
        none gets one empty message."""
        opened = self._start(StreamPiece("content")) if not self.output and self._open is None else []
        if self._open is not None and self._open.kind == "message":
            self._open.logprobs += self._logprobs
        return opened + self._close(rp.item_status(status))

    def _start(self, piece: StreamPiece) -> list[Event]:
        kind, index = _item_kind(piece), len(self.output)
        item = self._open = _OpenItem(kind, rp.item_id({"message": "msg", "reasoning": "rs"}.get(kind, "fc")), index)
        if kind == "function_call":
            item.call_id, item.name = piece.id or rp.item_id("call"), piece.name or ""
            added = rp.function_call_item(item.id, item.call_id, item.name, "", "in_progress")
            return [self.event("response.output_item.added", output_index=index, item=added)]
        added = rp.message_item(item.id, "", "in_progress") if kind == "message" else rp.reasoning_item(item.id)
        return [self.event("response.output_item.added", output_index=index, item=added),
                self.event("response.content_part.added", **self._where(), part=self._part(""))]

    def _delta(self, text: str) -> Event:
        item = self._open
        assert item is not None
        item.text += text
        if item.kind == "function_call":
            return self.event("response.function_call_arguments.delta", item_id=item.id, output_index=item.index,
                              delta=text)
        if item.kind == "reasoning":
            return self.event("response.reasoning_text.delta", **self._where(), delta=text)
        logprobs, self._logprobs = self._logprobs, []
        item.logprobs += logprobs
        return self.event("response.output_text.delta", **self._where(), delta=text, logprobs=logprobs)

    def _close(self, status: str = "completed") -> list[Event]:
        item = self._open
        if item is None:
            return []
        if item.kind == "function_call":
            done = rp.function_call_item(item.id, item.call_id, item.name, item.text, status)
            out = [self.event("response.function_call_arguments.done", item_id=item.id, output_index=item.index,
                              name=item.name, arguments=item.text)]
        else:
            message = item.kind == "message"
            done = rp.message_item(item.id, item.text, status, item.logprobs) if message \
                else rp.reasoning_item(item.id, item.text)
            text_done = self.event(f"response.{'output' if message else 'reasoning'}_text.done",
                                   **self._where(), text=item.text, **({"logprobs": item.logprobs} if message else {}))
            part = rp.output_text_part(item.text, item.logprobs) if message else self._part(item.text)
            out = [text_done, self.event("response.content_part.done", **self._where(), part=part)]
        self._open = None
        self.output.append(done)
        return out + [self.event("response.output_item.done", output_index=item.index, item=done)]

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.id, "output_index": self._open.index, "content_index": 0}

    def _part(self, text: str) -> dict[str, Any]:
        assert self._open is not None
        return rp.output_text_part(text) if self._open.kind == "message" else {"type": "reasoning_text", "text": text}


def _item_kind(piece: StreamPiece) -> str:
    if piece.kind in ("tool_call", "arguments"):
        return "function_call"
    return "reasoning" if piece.kind == "reasoning" else "message"
