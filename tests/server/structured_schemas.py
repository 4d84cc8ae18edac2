"""JSON schemas the structured-output tests generate against (jsonschema is the oracle), with a prompt
each: nested objects, arrays, enums, bounded numbers, additionalProperties false, $ref / $defs."""

from __future__ import annotations

from typing import Any

_PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
           "required": ["name", "age"], "additionalProperties": False}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", _PERSON),
    ("a city and its country", {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                                 "country": {"type": "string", "maxLength": 30}},
                                "required": ["city", "country"]}),
    ("a yes or no answer", {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}),
    ("a temperature in Celsius", {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50,
                                                                               "maximum": 60}},
                                  "required": ["celsius"], "additionalProperties": False}),
    ("three colours", {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string",
                                                                                                 "maxLength": 12},
                                                                    "minItems": 3, "maxItems": 3}},
                       "required": ["colours"]}),
    ("a list of small numbers", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                 "minItems": 1, "maxItems": 5}),
    ("a boolean flag", {"type": "object", "properties": {"enabled": {"type": "boolean"}}, "required": ["enabled"]}),
    ("a book with its author", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40},
        "author": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 20},
                                                    "last": {"type": "string", "maxLength": 20}},
                   "required": ["first", "last"], "additionalProperties": False}},
        "required": ["title", "author"], "additionalProperties": False}),
    ("a team of two people", {"type": "object", "properties": {"members": {"type": "array", "items": {"$ref": "#/$defs/p"},
                                                                           "minItems": 2, "maxItems": 2}},
                              "required": ["members"], "$defs": {"p": _PERSON}}),
    ("a point on a plane", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                                                             "y": {"type": "integer", "minimum": -100, "maximum": 100}},
                            "required": ["x", "y"], "additionalProperties": False}),
    ("a weekday", {"type": "string", "enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]}),
    ("a number of apples", {"type": "integer", "minimum": 1, "maximum": 50}),
    ("a product and its price", {"type": "object", "properties": {"product": {"type": "string", "maxLength": 30},
                                                                  "price": {"type": "number", "minimum": 0,
                                                                            "maximum": 1000}},
                                 "required": ["product", "price"], "additionalProperties": False}),
    ("an animal with its legs", {"type": "object", "properties": {"animal": {"type": "string", "maxLength": 20},
                                                                  "legs": {"enum": [0, 2, 4, 6, 8]}},
                                 "required": ["animal", "legs"]}),
    ("a short greeting", {"type": "object", "properties": {"greeting": {"type": "string", "minLength": 1,
                                                                        "maxLength": 30}},
                          "required": ["greeting"], "additionalProperties": False}),
    ("an address", {"type": "object", "properties": {"street": {"type": "string", "maxLength": 30},
                                                     "number": {"type": "integer", "minimum": 1, "maximum": 999},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "number", "zip"], "additionalProperties": False}),
    ("a task with a priority", {"type": "object", "properties": {"task": {"type": "string", "maxLength": 30},
                                                                 "priority": {"enum": ["low", "medium", "high"]},
                                                                 "done": {"type": "boolean"}},
                                "required": ["task", "priority", "done"], "additionalProperties": False}),
    ("a matrix of two rows", {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                      "maximum": 9},
                                                         "minItems": 2, "maxItems": 2},
                              "minItems": 2, "maxItems": 2}),
    ("a tree node with children", {"$ref": "#/$defs/node", "$defs": {"node": {
        "type": "object", "properties": {"label": {"type": "string", "maxLength": 10},
                                         "children": {"type": "array", "maxItems": 2,
                                                      "items": {"type": "object",
                                                                "properties": {"label": {"type": "string",
                                                                                         "maxLength": 10}},
                                                                "required": ["label"], "additionalProperties": False}}},
        "required": ["label", "children"], "additionalProperties": False}}}),
    ("an optional nickname", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                               "nickname": {"type": ["string", "null"], "maxLength": 20}},
                              "required": ["name", "nickname"], "additionalProperties": False}),
    ("a score between zero and one", {"type": "object", "properties": {"score": {"type": "number", "minimum": 0,
                                                                                 "maximum": 1}},
                                      "required": ["score"]}),
    ("a list of people", {"type": "object", "properties": {"people": {"type": "array", "items": _PERSON,
                                                                      "maxItems": 3}},
                          "required": ["people"], "additionalProperties": False}),
]


def prompt(description: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Reply with JSON only: {description}."}]
