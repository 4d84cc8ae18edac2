"""LiquidAI LFM2 / LFM2-MoE / LFM2.5 tool calls: a pythonic list of calls between special tokens.

    <|tool_call_start|>[get_weather(city="Paris", days=2)]<|tool_call_end|>The forecast is ...

The list is read as pythonic.py reads one (nothing is evaluated). llama.cpp's LFM2 template writes past
calls as a JSON list instead (``[{"name": ..., "arguments": {...}}]``), so a block holding such a list is
read too. Text before and after the block is content. ``<|tool_call_start|>`` and ``<|tool_call_end|>``
are special tokens of LFM2's tokenizer, so the response is decoded with them kept (as vLLM's lfm2 parser).
"""

from __future__ import annotations

from collections.abc import Sequence

from core.parsers import Tool
from core_templates.parsers.hermes import json_call_list
from core_templates.parsers.pythonic import pythonic_calls
from core_templates.parsers.tagged import Call, TaggedToolCallParser


class Lfm2ToolCallParser(TaggedToolCallParser):
    """``<|tool_call_start|>[f(a=1), g()]<|tool_call_end|>`` calls (LFM2, LFM2-MoE, LFM2.5)."""

    start_tag = "<|tool_call_start|>"
    end_tag = "<|tool_call_end|>"
    reads_special_tokens = True

    def parse_block(self, body: str, tools: Sequence[Tool] | None) -> list[Call] | None:
        return pythonic_calls(body) or json_call_list(body)
