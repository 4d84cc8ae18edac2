"""The default structured-output engine: xgrammar (core.structured_output's contract).

Registered by this plugin as "xgrammar" (imported only when a server first compiles a constraint, so
`core plugins` imports neither torch nor xgrammar). JSON schemas compile with fixed separators (", " and
": ", no free whitespace), so a small model cannot wander into endless whitespace inside an object.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

import xgrammar as xgr

from core.json_schema_features import FORMATS, VOCABULARY, SchemaSupport
from core.structured_output import (
    Constraint,
    ConstraintError,
    ConstraintMatcher,
    StructuredOutput,
    StructuredOutputEngine,
)

COMPILER_THREADS = 2

# What xgrammar 0.2.9 compiles but does not enforce (it generates instances that jsonschema rejects),
# found by compiling a schema per keyword and matching strings the jsonschema validator rejects
# Everything else in the vocabulary it enforces or,
# where it cannot, refuses to compile.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "patternProperties",
    "uniqueItems", "contains", "minContains", "maxContains", "additionalItems", "$anchor", "$dynamicRef",
    "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor",
})
UNSUPPORTED_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference", "regex"})
SCHEMA_SUPPORT = SchemaSupport(keywords=VOCABULARY - UNSUPPORTED_KEYWORDS, formats=FORMATS - UNSUPPORTED_FORMATS,
                               multiple_all_of=False, ref_siblings=False, integer_multiple_of_only=True)


class XGrammarMatcher(ConstraintMatcher):
    """An xgrammar GrammarMatcher behind the core's matcher contract."""

    def __init__(self, compiled: Any, stop_token_ids: Collection[int]) -> None:
        stops = sorted(stop_token_ids)
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None,
                                           terminate_without_stop_token=not stops)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XGrammarConstraint(Constraint):
    """A compiled xgrammar grammar."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled

    def matcher(self, stop_token_ids: Collection[int]) -> ConstraintMatcher:
        return XGrammarMatcher(self.compiled, stop_token_ids)


class XGrammarEngine(StructuredOutputEngine):
    """Compiles specs for one Hugging Face tokenizer; xgrammar caches what it compiled as well."""

    schema_support = SCHEMA_SUPPORT

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=COMPILER_THREADS)

    def compile(self, spec: StructuredOutput) -> Constraint:
        try:
            grammar = _grammar(spec)
            if spec.prefix or spec.suffix:
                grammar = xgr.Grammar.concat(*(g for g in (_literal(spec.prefix), grammar, _literal(spec.suffix)) if g))
            return XGrammarConstraint(self.compiler.compile_grammar(grammar))
        except ConstraintError:
            raise
        except Exception as exc:  # xgrammar reports every problem as a RuntimeError or ValueError
            raise ConstraintError(_first_line(exc)) from None


def _grammar(spec: StructuredOutput) -> Any:
    kind = spec.kind
    if kind == "json":
        return xgr.Grammar.from_json_schema(json.dumps(spec.json), any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema(json.dumps({"type": "object"}), any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_string(c) for c in spec.choice or ()))
    return xgr.Grammar.from_ebnf(spec.grammar)


def _literal(text: str) -> Any:
    return xgr.Grammar.from_ebnf(f"root ::= {_ebnf_string(text)}") if text else None


def _ebnf_string(text: str) -> str:
    """A quoted EBNF literal (JSON's escapes are EBNF's)."""
    return json.dumps(text, ensure_ascii=False)


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[16:30:52] /project/cpp/x.cc:94: "


def _first_line(exc: Exception) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return _SOURCE_PREFIX.sub("", lines[0]).strip() if lines else type(exc).__name__


def make_engine(tokenizer: Any, vocab_size: int) -> StructuredOutputEngine:
    """The registered factory."""
    return XGrammarEngine(tokenizer, vocab_size)
