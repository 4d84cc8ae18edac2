"""Mistral tool calls: ``[TOOL_CALLS]`` followed by a JSON list of calls, to the end of the response.

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

Mistral's templates require tool-call ids of exactly nine letters and digits, so ids here have that shape.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Sequence

from core.parsers import Tool, ToolCallFormat
from core_templates.parsers.hermes import json_call
from core_templates.parsers.tagged import Call, TaggedToolCallParser

_ID_ALPHABET = string.ascii_letters + string.digits


class MistralToolCallParser(TaggedToolCallParser):
    """A JSON list of calls after ``[TOOL_CALLS]`` (Mistral 7B v0.3, Mixtral 8x22B, Nemo, Small)."""

    start_tag = "[TOOL_CALLS]"
    end_tag = ""
    call_format = ToolCallFormat("[TOOL_CALLS][", "]")

    def parse_block(self, body: str, tools: Sequence[Tool] | None) -> list[Call] | None:
        try:
            calls = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if isinstance(calls, dict):
            calls = [calls]
        if not isinstance(calls, list) or not calls:
            return None
        parsed = [json_call(call) for call in calls]
        return None if None in parsed else parsed  # type: ignore[return-value]

    def new_tool_call_id(self) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))
