"""The protocols' structured-output fields as a core.structured_output.StructuredOutput.

OpenAI: ``response_format`` ``{"type": "json_object"}`` and ``{"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}`` (the name required, as OpenAI's); vLLM's extras ``structured_outputs: {json,
regex, choice, grammar, json_object}`` and the older ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``.
Anthropic: ``output_config.format`` ``{"type": "json_schema", "schema"}``.
A forced tool call (OpenAI ``tool_choice: "required"`` or a named function, Anthropic ``{"type": "any"}``
or ``{"type": "tool"}``) becomes a JSON constraint in the tool-call parser's own format (its
``call_format``; a bare JSON object where the server has no parser that writes JSON:
core.forced_tool_call), so what is generated is what the parser reads back. Each error names its field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from core.errors import InvalidRequestError, UnsupportedError
from core.forced_tool_call import PLAIN_JSON_CALL, ForcedToolCall
from core.parsers import ToolCallFormat
from core.server.openai_protocol import check_name
from core.structured_output import StructuredOutput

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def response_format_constraint(response_format: Mapping[str, Any] | None) -> StructuredOutput | None:
    """OpenAI's response_format; "text" (or none) is unconstrained."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True, param="response_format")
    if kind != "json_schema":
        raise InvalidRequestError(f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}',
                                  param="response_format.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), (Mapping, bool)):
        raise InvalidRequestError("response_format.json_schema must be an object with a schema object",
                                  param="response_format.json_schema")
    check_name(spec.get("name"), "response_format.json_schema.name")  # required by OpenAI, though unused here
    schema = spec.get("schema", {"type": "object"})
    return StructuredOutput(json=schema, param="response_format.json_schema.schema")


def output_format_constraint(output_config: Mapping[str, Any] | None) -> StructuredOutput | None:
    """Anthropic's ``output_config.format``, ``{"type": "json_schema", "schema": {...}}`` (what the anthropic
    client's ``messages.parse(output_format=...)`` sends); ``output_config.effort`` changes nothing here."""
    spec = (output_config or {}).get("format")
    if spec is None:
        return None
    schema = spec.get("schema") if isinstance(spec, Mapping) and spec.get("type") == "json_schema" else None
    if not isinstance(schema, Mapping):
        raise InvalidRequestError('output_config.format must be {"type": "json_schema", "schema": {...}}',
                                  param="output_config.format")
    return StructuredOutput(json=schema, param="output_config.format.schema")


def vllm_constraint(fields: Mapping[str, Any]) -> StructuredOutput | None:
    """vLLM's ``structured_outputs`` object or one of the ``guided_*`` fields (at most one is sent)."""
    sent = {name: value for name, value in fields.items() if value is not None}
    if "structured_outputs" in sent:
        return _structured_outputs(sent["structured_outputs"])
    for name, kind in GUIDED_FIELDS.items():
        if name in sent:
            return StructuredOutput(**{kind: sent[name]}, param=name)
    return None


def _structured_outputs(value: Any) -> StructuredOutput:
    if not isinstance(value, Mapping):
        raise InvalidRequestError("structured_outputs must be an object", param="structured_outputs")
    unknown = sorted(set(value) - set(STRUCTURED_KEYS) - {"disable_any_whitespace", "whitespace_pattern"})
    if unknown:
        raise UnsupportedError(f"structured_outputs.{unknown[0]} is not supported; use one of "
                               f"{', '.join(STRUCTURED_KEYS)}", param=f"structured_outputs.{unknown[0]}")
    chosen = {k: v for k, v in value.items() if k in STRUCTURED_KEYS and v not in (None, False)}
    param = f"structured_outputs.{next(iter(chosen))}" if len(chosen) == 1 else "structured_outputs"
    return StructuredOutput(**chosen, param=param)


def one_constraint(*found: StructuredOutput | None) -> StructuredOutput | None:
    """The request's one constraint; sending two (say response_format and guided_json) is a 400."""
    sent = [spec for spec in found if spec is not None]
    if len(sent) > 1:
        raise InvalidRequestError(f"{sent[0].param} and {sent[1].param} both constrain the output; send one",
                                  param=sent[1].param)
    return sent[0] if sent else None


def tool_call_constraint(tools: Sequence[Mapping[str, Any]] | None, name: str | None,
                         call_format: ToolCallFormat | None, param: str = "tool_choice") -> ForcedToolCall:
    """One call of the tool `name` (None: any of `tools`) whose arguments match its parameters, written
    in `call_format` (the server's tool-call parser's; None: the bare JSON object that
    `core.forced_tool_call.ForcedCallParser` reads, for a server without a parser that writes JSON).

    :raises InvalidRequestError: no tools, or `name` is not one of them (naming `param`).
    """
    functions = [tool.get("function", tool) for tool in tools or ()]
    if not functions:
        raise InvalidRequestError(f"{param} forces a tool call, but the request sends no tools", param=param)
    if name is not None:
        functions = [f for f in functions if f.get("name") == name]
        if not functions:
            raise InvalidRequestError(f"{param} names the function {name!r}, which is not in tools", param=param)
    call_format = call_format or PLAIN_JSON_CALL
    calls = [_call_schema(f, call_format.arguments_key) for f in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return ForcedToolCall(json=schema, prefix=call_format.begin, suffix=call_format.end, param=param)


def _call_schema(function: Mapping[str, Any], arguments_key: str) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function.get("name")}, arguments_key: parameters},
            "required": ["name", arguments_key], "additionalProperties": False}
