"""DeepSeek V3 / R1 and V3.1 tool calls: a section of calls between ``<｜tool▁calls▁begin｜>`` and
``<｜tool▁calls▁end｜>`` (or the end of the response).

V3 and R1 write each call's type, then its name and its arguments in a fenced JSON block:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 writes the name and the JSON arguments alone:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
    <｜tool▁calls▁end｜>

A section holding anything but complete calls (whitespace between them aside) is kept as content.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from collections.abc import Sequence

from core.parsers import Tool
from core_templates.parsers.common import arguments_json
from core_templates.parsers.tagged import Call, TaggedToolCallParser

_CALL = re.compile(r"\s*<｜tool▁call▁begin｜>([^<]*)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>\s*", re.DOTALL)
_FENCED = re.compile(r"([^\n]+)\n\s*```(?:json)?\s*\n(.*)\n\s*```\s*", re.DOTALL)


class _DeepSeekToolCallParser(TaggedToolCallParser):
    """The section both versions share; `read_call` reads one call's two parts."""

    start_tag = "<｜tool▁calls▁begin｜>"
    end_tag = "<｜tool▁calls▁end｜>"

    def parse_block(self, body: str, tools: Sequence[Tool] | None) -> list[Call] | None:
        calls, pos = [], 0
        while pos < len(body) or not calls:
            match = _CALL.match(body, pos)
            call = self.read_call(match[1], match[2]) if match else None
            if call is None:
                return None
            calls.append(call)
            pos = match.end()  # type: ignore[union-attr]
        return calls

    @abstractmethod
    def read_call(self, head: str, tail: str) -> Call | None:
        """(name, arguments JSON) of a call written ``HEAD<｜tool▁sep｜>TAIL``, or None when malformed."""


class DeepSeekV3ToolCallParser(_DeepSeekToolCallParser):
    """DeepSeek V3 and R1: ``TYPE<｜tool▁sep｜>NAME`` and the arguments in a fenced JSON block."""

    def read_call(self, head: str, tail: str) -> Call | None:
        match = _FENCED.fullmatch(tail)
        name = match[1].strip() if match else ""
        arguments = arguments_json(match[2]) if match and name else None
        return None if arguments is None else (name, arguments)


class DeepSeekV31ToolCallParser(_DeepSeekToolCallParser):
    """DeepSeek V3.1: ``NAME<｜tool▁sep｜>ARGUMENTS``."""

    def read_call(self, head: str, tail: str) -> Call | None:
        name, arguments = head.strip(), arguments_json(tail)
        return (name, arguments) if name and arguments is not None else None
