"""Streamed Anthropic content blocks: parsed stream pieces become content_block_start / _delta / _stop events.

Reasoning streams as a ``thinking`` block (``thinking_delta``), content as a ``text`` block (``text_delta``),
and each tool call as a ``tool_use`` block whose input arrives as ``input_json_delta`` pieces. A block stays
open while pieces of its kind keep coming; the next kind (or the next tool call) closes it first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.server.postprocess import StreamPiece

Event = tuple[str, dict[str, Any]]


def _start_block(piece: StreamPiece) -> dict[str, Any]:
    if piece.kind == "reasoning":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if piece.kind == "tool_call":
        return {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}
    return {"type": "text", "text": ""}


def _delta(piece: StreamPiece) -> dict[str, Any]:
    if piece.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": piece.text}
    if piece.kind == "arguments":
        return {"type": "input_json_delta", "partial_json": piece.text}
    return {"type": "text_delta", "text": piece.text}


class ContentBlockEvents:
    """The content-block events of one streamed message, block by block."""

    def __init__(self) -> None:
        self._index = -1
        self._open: tuple[str, int] | None = None  # (kind, tool index) of the open block

    def events(self, pieces: Sequence[StreamPiece]) -> list[Event]:
        """The events that `pieces` (in order) produce."""
        out: list[Event] = []
        for piece in pieces:
            if piece.kind == "tool_call" or self._open is None or self._open[0] != _block_kind(piece):
                out += self._close()
                self._index += 1
                self._open = (_block_kind(piece), piece.index)
                out.append(("content_block_start", {"type": "content_block_start", "index": self._index,
                                                    "content_block": _start_block(piece)}))
            if piece.kind != "tool_call":
                out.append(("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                                    "delta": _delta(piece)}))
        return out

    def open_text(self) -> list[Event]:
        """Open a text block before any text arrives (plain responses start their only block at once)."""
        out = self._close()
        self._index += 1
        self._open = ("content", 0)
        return out + [("content_block_start", {"type": "content_block_start", "index": self._index,
                                               "content_block": {"type": "text", "text": ""}})]

    def finish(self) -> list[Event]:
        """Close the open block; a message that had no block at all gets one empty text block."""
        return (self.open_text() if self._index < 0 else []) + self._close()

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._index})]


def _block_kind(piece: StreamPiece) -> str:
    return "tool_use" if piece.kind in ("tool_call", "arguments") else piece.kind
