"""NVIDIA Nemotron JSON tool calls (Nemotron Nano 2, Llama-Nemotron): a JSON list between ``<TOOLCALL>`` tags.

    <TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>

Text before the block is content. The tags may be special tokens, so the response is decoded with them
kept (as vLLM's nemotron parsers). A block that is not a list of complete calls is content.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.parsers import Tool, ToolCallFormat
from core_templates.parsers.hermes import json_call_list
from core_templates.parsers.tagged import Call, TaggedToolCallParser


class NemotronJsonToolCallParser(TaggedToolCallParser):
    """``<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`` calls."""

    start_tag = "<TOOLCALL>"
    end_tag = "</TOOLCALL>"
    call_format = ToolCallFormat("<TOOLCALL>[", "]</TOOLCALL>")
    reads_special_tokens = True

    def parse_block(self, body: str, tools: Sequence[Tool] | None) -> list[Call] | None:
        return json_call_list(body)
