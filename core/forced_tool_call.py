"""A forced tool call where no tool-call parser writes JSON: generated as a bare JSON object, read back as a call.

OpenAI's ``tool_choice: "required"`` or a named function (Anthropic's ``{"type": "any"}`` or ``{"type":
"tool"}``) is generated under a JSON constraint in the tool-call parser's format, so that the parser reads
the call back. A server started without one (``--tool-call-parser`` not given and none registered for the
model), or with one whose calls are not JSON, still honours a forced call, as vLLM does without
``--enable-auto-tool-choice``: the constraint is the bare object ``{"name": ..., "arguments": {...}}``
(`PLAIN_JSON_CALL`), and `ForcedCallParser` turns that output into the call. It reads nothing else, so such
a server still returns every other response (``tool_choice: "auto"`` included) as plain content.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from core.parsers import (
    ParsedToolCalls,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolCallFormat,
    ToolCallFragment,
    ToolCallParser,
    new_tool_call_id,
)
from core.structured_output import StructuredOutput

PLAIN_JSON_CALL = ToolCallFormat()


@dataclass(frozen=True)
class ForcedToolCall(StructuredOutput):
    """The constraint of a forced tool call (`core.server.structured_fields.tool_call_constraint`), so that
    the response's postprocessor knows the output is a call even where the server has no parser."""


class ForcedCallParser(ToolCallParser):
    """Reads a response generated under a `PLAIN_JSON_CALL` constraint as its one tool call. Streamed, the
    call comes whole at the end (its name is only known once the object is); output that is not such an
    object (cut short by ``max_tokens``) is plain content, as any parser returns what it cannot read."""

    call_format = PLAIN_JSON_CALL

    def __init__(self, tokenizer: object = None) -> None:
        super().__init__(tokenizer)
        self._held = ""

    def parse(self, text: str, tools: Sequence[Tool] | None = None) -> ParsedToolCalls:
        call = _call(text)
        return ParsedToolCalls(text) if call is None else ParsedToolCalls("", (call,))

    def feed(self, delta: str) -> ToolCallDelta:
        self._held += delta
        return ToolCallDelta()

    def flush(self) -> ToolCallDelta:
        text, self._held = self._held, ""
        call = _call(text)
        if call is None:
            return ToolCallDelta(content=text)
        return ToolCallDelta(tool_calls=(ToolCallFragment(0, call.id, call.name),
                                         ToolCallFragment(0, arguments=call.arguments)))


def _call(text: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
        return None
    name, arguments = value["name"], value["arguments"]
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return ToolCall(new_tool_call_id(), name, json.dumps(arguments, ensure_ascii=False))
