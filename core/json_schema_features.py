"""Which JSON-schema keywords a structured-output engine enforces, and a walker that finds the others.

A grammar engine compiles a JSON schema into a grammar; a keyword it does not turn into grammar (xgrammar
skips `not`, `if`/`then`/`else`, `uniqueItems`, ...) would let the model generate instances the schema
rejects. So an engine declares what it enforces (`SchemaSupport`) and `unsupported_feature` walks a schema
(every subschema: properties, items, $defs / definitions, anyOf / oneOf / allOf, ...) for the first
keyword outside it, named by its JSON path ("properties.a.not").

Only the JSON-Schema vocabulary (`VOCABULARY`, drafts 4 to 2020-12) is checked: annotations (`ANNOTATIONS`)
and keywords the standard does not define (vendor extensions, pydantic's ``discriminator``) constrain
nothing, for the `jsonschema` validator as for the engine, so they pass. Likewise a ``format`` the
standard does not define passes; a standard one must be in the engine's `formats`.

Nothing here imports torch or an engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

ANNOTATIONS = frozenset({
    "title", "description", "examples", "default", "$comment", "deprecated", "readOnly", "writeOnly",
    "$schema", "$id", "$vocabulary", "contentEncoding", "contentMediaType", "contentSchema",
})

# keywords whose value is one subschema, a name -> subschema map, or a list of subschemas
_ONE = ("additionalProperties", "propertyNames", "unevaluatedProperties", "additionalItems", "contains",
        "unevaluatedItems", "not", "if", "then", "else")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")

VOCABULARY = frozenset({
    *_ONE, *_MAP, *_LIST, "items", "type", "enum", "const", "$ref", "$anchor", "$dynamicRef", "$dynamicAnchor",
    "$recursiveRef", "$recursiveAnchor", "required", "minProperties", "maxProperties", "dependentRequired",
    "minItems", "maxItems", "uniqueItems", "minContains", "maxContains", "minLength", "maxLength", "pattern",
    "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})

FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "iri-reference", "uri-template", "uuid", "json-pointer",
    "relative-json-pointer", "regex",
})

# containers of subschemas whose own keys are names, not keywords
_DEFINITIONS = ("$defs", "definitions")


@dataclass(frozen=True)
class SchemaSupport:
    """What an engine enforces.

    :param keywords: the vocabulary keywords it turns into grammar (every other `VOCABULARY` keyword is
        rejected).
    :param formats: the standard ``format`` values it enforces.
    :param multiple_all_of: whether ``allOf`` may have more than one subschema (one is always fine).
    :param ref_siblings: whether keywords beside ``$ref`` constrain (annotations and $defs always may).
    :param integer_multiple_of_only: whether ``multipleOf`` is enforced only on ``"type": "integer"``.
    """

    keywords: frozenset[str]
    formats: frozenset[str] = FORMATS
    multiple_all_of: bool = True
    ref_siblings: bool = True
    integer_multiple_of_only: bool = False


def unsupported_feature(schema: Any, support: SchemaSupport) -> str | None:
    """The first keyword of `schema` that `support` does not cover, as "PATH is not supported ..." text;
    None when the engine enforces all of it."""
    for path, reason in _walk(schema, (), support):
        where = ".".join(path)
        return f"{where}{reason} is not supported by the structured-output engine"
    return None


def _walk(schema: Any, path: tuple[str, ...], support: SchemaSupport) -> Iterator[tuple[tuple[str, ...], str]]:
    if not isinstance(schema, Mapping):
        return  # a boolean schema (or something the engine itself rejects as invalid)
    has_ref = "$ref" in schema
    for key, value in schema.items():
        here = (*path, str(key))
        if key in ANNOTATIONS or key not in VOCABULARY:
            continue
        if key not in support.keywords:
            yield here, ""
            continue
        if has_ref and key not in ("$ref", *_DEFINITIONS) and not support.ref_siblings:
            yield here, " beside $ref"
            continue
        if key == "$ref" and isinstance(value, str) and value != "#" and not value.startswith("#/"):
            yield here, f" to {value!r} (only local '#/...' references are)"
            continue
        if key == "format" and value in FORMATS and value not in support.formats:
            yield here, f" {value!r}"
            continue
        if key == "allOf" and isinstance(value, list) and len(value) > 1 and not support.multiple_all_of:
            yield here, " with more than one schema"
            continue
        if key == "multipleOf" and support.integer_multiple_of_only and schema.get("type") != "integer":
            yield here, " on a non-integer type"
            continue
        yield from _children(key, value, here, support)


def _children(key: str, value: Any, here: tuple[str, ...], support: SchemaSupport) -> Iterator[tuple[tuple[str, ...], str]]:
    if key in _ONE:
        yield from _walk(value, here, support)
    elif key == "items":
        if isinstance(value, list):
            for i, item in enumerate(value):
                yield from _walk(item, (*here, str(i)), support)
        else:
            yield from _walk(value, here, support)
    elif key in _MAP and isinstance(value, Mapping):
        for name, sub in value.items():
            yield from _walk(sub, (*here, str(name)), support)
    elif key in _LIST and isinstance(value, list):
        for i, sub in enumerate(value):
            yield from _walk(sub, (*here, str(i)), support)
