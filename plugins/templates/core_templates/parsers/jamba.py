"""AI21 Jamba tool calls: a JSON list of calls between ``<tool_calls>`` and ``</tool_calls>``.

    <tool_calls>[
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    ]</tool_calls>

Text before the block is content. The two tags are special tokens of Jamba's tokenizer, so the response is
decoded with them kept (as vLLM's jamba parser). A block that is not a list of complete calls is content.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.parsers import Tool, ToolCallFormat
from core_templates.parsers.hermes import json_call_list
from core_templates.parsers.tagged import Call, TaggedToolCallParser


class JambaToolCallParser(TaggedToolCallParser):
    """``<tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>`` calls (Jamba 1.5 - 1.7)."""

    start_tag = "<tool_calls>"
    end_tag = "</tool_calls>"
    call_format = ToolCallFormat("<tool_calls>[", "]</tool_calls>")
    reads_special_tokens = True

    def parse_block(self, body: str, tools: Sequence[Tool] | None) -> list[Call] | None:
        return json_call_list(body)
