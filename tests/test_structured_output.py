"""Structured output without a model: the spec, the request fields, forced tool calls, the compile cache,
the engine hook and its resolver, and the 400 of an engine that cannot constrain."""

from __future__ import annotations

import pytest

from core import GenerationConfig, hookimpl
from core.errors import InvalidRequestError, PluginError, UnsupportedError
from core.forced_tool_call import ForcedToolCall
from core.parsers import ToolCallFormat
from core.plugins import load_plugins
from core.resolve import structured_output_engine
from core.server import structured_fields as sf
from core.structured_output import (
    Constraint,
    ConstraintCompiler,
    ConstraintError,
    StructuredOutput,
    StructuredOutputEngine,
)

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "g"}}]


def test_a_spec_sets_exactly_one_constraint_and_equal_specs_share_a_key():
    with pytest.raises(InvalidRequestError):
        StructuredOutput()
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutput(regex="a", choice=["b"], param="structured_outputs")
    assert info.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError):
        StructuredOutput(choice=[])
    assert StructuredOutput(json='{"b": 1, "a": 2}').key == StructuredOutput(json={"a": 2, "b": 1}).key
    assert StructuredOutput(choice=["x"]).kind == "choice"
    assert GenerationConfig(structured_output=StructuredOutput(regex="a")).structured_output.regex == "a"
    with pytest.raises(InvalidRequestError):
        GenerationConfig(structured_output={"regex": "a"})


def test_openai_and_vllm_fields():
    assert sf.response_format_constraint({"type": "text"}) is None
    assert sf.response_format_constraint({"type": "json_object"}).json_object
    spec = sf.response_format_constraint({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}})
    assert spec.json == {"type": "string"} and spec.param == "response_format.json_schema.schema"
    assert sf.vllm_constraint({"guided_choice": ["a", "b"]}).choice == ("a", "b")
    assert sf.vllm_constraint({"structured_outputs": {"regex": "a+"}}).param == "structured_outputs.regex"
    with pytest.raises(UnsupportedError):
        sf.vllm_constraint({"structured_outputs": {"structural_tag": "x"}})
    with pytest.raises(InvalidRequestError) as info:
        sf.one_constraint(StructuredOutput(regex="a", param="response_format"),
                          StructuredOutput(regex="b", param="guided_regex"))
    assert info.value.param == "guided_regex"


def test_forced_tool_calls_use_the_parsers_format():
    hermes = ToolCallFormat("<tool_call>\n", "\n</tool_call>")
    spec = sf.tool_call_constraint(TOOLS, "g", hermes)
    assert spec.prefix == "<tool_call>\n" and spec.suffix == "\n</tool_call>"
    assert spec.json["properties"]["name"] == {"const": "g"}
    assert len(sf.tool_call_constraint(TOOLS, None, ToolCallFormat(arguments_key="parameters")).json["anyOf"]) == 2
    with pytest.raises(InvalidRequestError):
        sf.tool_call_constraint(TOOLS, "nope", hermes)
    with pytest.raises(InvalidRequestError):
        sf.tool_call_constraint(None, None, hermes)
    plain = sf.tool_call_constraint(TOOLS, "g", None)  # no parser that writes JSON: the bare call object
    assert isinstance(plain, ForcedToolCall) and plain.prefix == plain.suffix == ""
    assert plain.json["required"] == ["name", "arguments"] and plain.json["properties"]["name"] == {"const": "g"}


class NoMatcher(Constraint):
    def matcher(self, stop_token_ids):
        raise NotImplementedError


class CountingEngine(StructuredOutputEngine):
    def __init__(self, tokenizer, vocab_size):
        self.compiled = []

    def compile(self, spec):
        if spec.regex == "(":
            raise ConstraintError("the parenthesis is not closed")
        self.compiled.append(spec.key)
        return NoMatcher()


def test_each_distinct_spec_compiles_once_and_errors_name_the_field():
    engines = []
    compiler = ConstraintCompiler("counting", lambda t, v: engines.append(CountingEngine(t, v)) or engines[-1], None, 8)
    first = compiler.compile(StructuredOutput(regex="a"))
    assert compiler.compile(StructuredOutput(regex="a")) is first
    compiler.compile(StructuredOutput(regex="b"))
    assert len(engines) == 1 and len(engines[0].compiled) == 2
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(StructuredOutput(regex="(", param="guided_regex"))
    assert info.value.param == "guided_regex" and "parenthesis" in str(info.value)


def test_hook_core_register_structured_output_engines():
    class Low:
        @hookimpl
        def core_register_structured_output_engines(self, register):
            register("low", CountingEngine, priority=1)

    class High:
        @hookimpl
        def core_register_structured_output_engines(self, register):
            register("high", "tests.test_structured_output:CountingEngine", priority=5, description="x")

    host = load_plugins(allow="", use_environment=False)
    assert structured_output_engine(host, None) is None
    host.register(Low())
    host.register(High())
    assert structured_output_engine(host, None).name == "high"
    assert structured_output_engine(host, "low").load() is CountingEngine
    with pytest.raises(PluginError, match="low, high|high, low"):
        structured_output_engine(host, "nope")


async def test_a_backend_that_cannot_constrain_answers_400(engine):
    config = GenerationConfig(max_new_tokens=2, structured_output=StructuredOutput(regex="a"))
    with pytest.raises(UnsupportedError) as info:
        await engine.prepare("hi", config)
    assert info.value.param == "structured_output"


# -- the unsupported-keyword pre-check (core.json_schema_features) ---------------------------------------

from core.json_schema_features import ANNOTATIONS, VOCABULARY, SchemaSupport, unsupported_feature  # noqa: E402

STRICT = SchemaSupport(keywords=VOCABULARY - {"not", "patternProperties", "uniqueItems", "if", "then", "else"},
                       formats=frozenset({"date"}), multiple_all_of=False, ref_siblings=False,
                       integer_multiple_of_only=True)


@pytest.mark.parametrize(("schema", "path"), [
    ({"not": {"type": "string"}}, "not"),
    ({"type": "object", "properties": {"a": {"patternProperties": {"^x": {}}}}}, "properties.a.patternProperties"),
    ({"$ref": "#/$defs/p", "$defs": {"p": {"type": "array", "uniqueItems": True}}}, "$defs.p.uniqueItems"),
    ({"definitions": {"p": {"if": {"type": "integer"}}}}, "definitions.p.if"),
    ({"type": "array", "items": {"type": "object", "properties": {"b": {"not": {}}}}}, "items.properties.b.not"),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"not": {}}]}, "prefixItems.1.not"),
    ({"anyOf": [{"type": "null"}, {"oneOf": [{"allOf": [{"not": {}}]}]}]}, "anyOf.1.oneOf.0.allOf.0.not"),
    ({"additionalProperties": {"uniqueItems": True}}, "additionalProperties.uniqueItems"),
])
def test_the_walker_names_the_json_path_of_an_unsupported_keyword(schema, path):
    assert unsupported_feature(schema, STRICT) == f"{path} is not supported by the structured-output engine"


@pytest.mark.parametrize(("schema", "problem"), [
    ({"type": "string", "format": "iri"}, "format 'iri'"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf with more than one schema"),
    ({"properties": {"a": {"$ref": "#/$defs/p", "minimum": 3}}}, "properties.a.minimum beside $ref"),
    ({"$ref": "#P"}, "$ref to '#P' (only local '#/...' references are)"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf on a non-integer type"),
])
def test_the_walker_rejects_what_the_engine_enforces_only_in_part(schema, problem):
    assert unsupported_feature(schema, STRICT) == f"{problem} is not supported by the structured-output engine"


def test_annotations_extensions_and_supported_keywords_pass():
    annotated = {key: "x" for key in ANNOTATIONS} | {
        "type": "object", "discriminator": {"propertyName": "k"}, "x-vendor": {"not": {}},
        "properties": {"not": {"type": "integer", "multipleOf": 3}, "pattern": {"type": "string", "pattern": "^a$"},
                       "d": {"type": "string", "format": "date"}, "f": {"type": "string", "format": "made-up"},
                       "r": {"$ref": "#/$defs/p", "description": "a ref with an annotation"},
                       "one": {"allOf": [{"$ref": "#/$defs/p"}]}},
        "required": ["not"], "additionalProperties": False, "$defs": {"p": {"anyOf": [{"type": "null"}, True]}}}
    assert unsupported_feature(annotated, STRICT) is None
    assert unsupported_feature(True, STRICT) is None
    assert unsupported_feature({"not": {}}, SchemaSupport(keywords=VOCABULARY)) is None


def test_the_compiler_asks_the_engine_and_a_rejected_schema_is_a_400_naming_the_field():
    compiled = []

    class Picky(StructuredOutputEngine):
        schema_support = STRICT

        def compile(self, spec):
            compiled.append(spec)
            return FixedConstraint()

    class FixedConstraint(Constraint):
        def matcher(self, stop_token_ids):
            raise AssertionError

    compiler = ConstraintCompiler("picky", lambda tokenizer, vocab: Picky(), None, 0)
    spec = StructuredOutput(json={"properties": {"a": {"not": {}}}}, param="response_format.json_schema.schema")
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(spec)
    assert info.value.param == "response_format.json_schema.schema"
    assert str(info.value) == ("response_format.json_schema.schema: properties.a.not is not supported by the "
                               "structured-output engine")
    assert compiled == []
    compiler.compile(StructuredOutput(regex="not"))  # only JSON schemas are checked
    assert len(compiled) == 1


def test_the_xgrammar_engine_declares_what_it_enforces():
    pytest.importorskip("xgrammar")
    from core_pytorch_backend.xgrammar_engine import SCHEMA_SUPPORT, XGrammarEngine

    assert XGrammarEngine.schema_support is SCHEMA_SUPPORT
    for keyword in ("not", "if", "patternProperties", "uniqueItems", "contains", "dependentRequired"):
        assert unsupported_feature({keyword: {}}, SCHEMA_SUPPORT) is not None, keyword
    for keyword in ("properties", "required", "additionalProperties", "items", "prefixItems", "anyOf", "oneOf",
                    "enum", "const", "pattern", "minLength", "maximum", "minItems", "propertyNames", "$defs"):
        assert unsupported_feature({keyword: {}}, SCHEMA_SUPPORT) is None, keyword
