"""Structured output: what a request constrains its output to, and the contract of the engines that do it.

A `StructuredOutput` names one constraint (a JSON schema, any JSON object, a regular expression, one of
several strings, or an EBNF grammar), optionally between literal text (a tool call's tags). It is a plain,
hashable value: the routes build it from the protocols' fields (core.server.structured_fields), Python
callers put it in `GenerationConfig.structured_output`.

A structured-output engine (registered through ``core_register_structured_output_engines``; xgrammar is
the default) compiles a spec for one tokenizer into a `Constraint`; each choice of a request gets its own
`ConstraintMatcher` from it, which the backend's sampler asks for the allowed tokens every step (a packed
bitmask, the layout xgrammar and llguidance share) and tells the token it sampled. `ConstraintCompiler`
compiles each distinct spec once (an LRU cache on the engine, which is built for the served tokenizer)
on the calling thread: the preparation thread, never the event loop or the backend's step. With a
reasoning model the server wraps it (`Constraint.after`) so that it applies after the reasoning section.

Nothing here imports torch or an engine.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.errors import InvalidRequestError, UnsupportedError
from core.json_schema_features import SchemaSupport, unsupported_feature

CACHE_SIZE = 256  # compiled constraints kept per engine
KINDS = ("json", "json_object", "regex", "choice", "grammar")


class ConstraintError(ValueError):
    """An engine cannot compile a spec: an invalid or unsupported schema, a bad regex, a grammar error."""


def _freeze(value: Any) -> str:
    """A JSON value as canonical text (sorted keys), so equal specs have one key."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class StructuredOutput:
    """One output constraint: exactly one of `json` (a JSON schema, a dict or its JSON text),
    `json_object` (any JSON object), `regex`, `choice` (one of these strings) or `grammar` (EBNF, as
    xgrammar and GBNF write it). `prefix` and `suffix` are literal text around the constrained part.

    :param param: the request field the constraint came from, named by the 400 when it does not compile.
    """

    json: Mapping[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    prefix: str = ""
    suffix: str = ""
    param: str = field(default="structured_output", compare=False)

    def __post_init__(self) -> None:
        chosen = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(chosen) != 1:
            found = ", ".join(chosen) or "none"
            raise InvalidRequestError(f"a structured output sets exactly one of {', '.join(KINDS)} (got {found})",
                                      param=self.param)
        self._check_value(chosen[0])
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))

    def _check_value(self, kind: str) -> None:
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, str):
            try:
                object.__setattr__(self, "json", json.loads(value))
            except ValueError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}", param=self.param) from None
            value = self.json
        checks = {"json": isinstance(value, (Mapping, bool)), "json_object": value is True,
                  "regex": isinstance(value, str) and bool(value), "grammar": isinstance(value, str) and bool(value),
                  "choice": isinstance(value, (list, tuple)) and bool(value) and all(isinstance(c, str) for c in value)}
        if not checks[kind]:
            expected = {"json": "a JSON schema object", "json_object": "true", "regex": "a non-empty string",
                        "grammar": "a non-empty string", "choice": "a non-empty list of strings"}[kind]
            raise InvalidRequestError(f"{kind} must be {expected}, got {value!r}", param=self.param)
        if not isinstance(self.prefix, str) or not isinstance(self.suffix, str):
            raise InvalidRequestError("prefix and suffix must be strings", param=self.param)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def value(self) -> Any:
        return getattr(self, self.kind)

    @property
    def key(self) -> str:
        """The spec as canonical text: equal specs compile once."""
        return _freeze({"kind": self.kind, "value": self.value, "prefix": self.prefix, "suffix": self.suffix})

    def __hash__(self) -> int:
        return hash(self.key)


# -- the engine contract -------------------------------------------------------------------------------


class ConstraintMatcher(ABC):
    """One choice's position in its constraint. Lives on the backend's step thread."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask`, an int32 tensor ``[rows, ceil(V/32)]``
        (bit j of word i allows token 32 i + j)."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance past `token_id`; False when the constraint does not allow it (the state is unchanged)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the constraint is complete and has accepted its stop token (or needs none)."""


class Constraint(ABC):
    """A compiled spec, shared by every request (and choice) that asks for it.

    ``starts_after`` is the token ids a choice generates, unconstrained, before the constraint applies to
    it (a reasoning model's end of reasoning, e.g. ``</think>``); () applies it from the first token. A
    backend creates a choice's matcher on the first sample after its output ends with them.
    """

    starts_after: tuple[int, ...] = ()

    @abstractmethod
    def matcher(self, stop_token_ids: Collection[int]) -> ConstraintMatcher:
        """A fresh matcher; once the constraint is complete it allows only `stop_token_ids` (none: it
        terminates without a stop token)."""

    def after(self, marker: Sequence[int]) -> Constraint:
        """This constraint, applied only once the output has generated the tokens `marker` (none: itself).
        The compiled constraint is shared, so this is a new one around it."""
        return _After(self, tuple(marker)) if marker else self


class _After(Constraint):
    """A constraint that starts after a marker (`Constraint.after`)."""

    def __init__(self, inner: Constraint, marker: tuple[int, ...]) -> None:
        self.inner, self.starts_after = inner, marker

    def matcher(self, stop_token_ids: Collection[int]) -> ConstraintMatcher:
        return self.inner.matcher(stop_token_ids)


class StructuredOutputEngine(ABC):
    """Compiles specs for one tokenizer. A plugin registers ``factory(tokenizer, vocab_size)`` building it.

    ``schema_support`` declares the JSON-schema keywords (and formats) the engine enforces; a schema using
    another one is a 400 before it compiles (`check_schema`). None checks nothing.
    """

    schema_support: SchemaSupport | None = None

    def check_schema(self, schema: Any) -> None:
        """Reject a JSON schema that uses a keyword the engine would not enforce.

        :raises ConstraintError: naming the keyword's JSON path, e.g. ``properties.a.not``.
        """
        if self.schema_support is not None:
            problem = unsupported_feature(schema, self.schema_support)
            if problem is not None:
                raise ConstraintError(problem)

    @abstractmethod
    def compile(self, spec: StructuredOutput) -> Constraint:
        """The compiled constraint; may take milliseconds to seconds, so it never runs on a hot thread.

        :raises ConstraintError: the spec is invalid or uses a feature the engine does not support.
        """


EngineFactory = Callable[[Any, int], StructuredOutputEngine]


class ConstraintCompiler:
    """The served model's engine (built on first use) and its compiled constraints, one per distinct spec.

    The engine is built for one tokenizer, so the cache key is the spec and the tokenizer together.
    """

    def __init__(self, name: str, factory: EngineFactory, tokenizer: Any, vocab_size: int) -> None:
        self.name = name
        self._factory, self._tokenizer, self._vocab_size = factory, tokenizer, vocab_size
        self._engine: StructuredOutputEngine | None = None
        self._cache: OrderedDict[str, Constraint] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> Constraint:
        """The spec's constraint, compiled once; a spec that does not compile is a 400 naming its field."""
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            if self._engine is None:
                self._engine = self._factory(self._tokenizer, self._vocab_size)
        try:
            if spec.kind == "json":
                self._engine.check_schema(spec.json)
            compiled = self._engine.compile(spec)
        except ConstraintError as exc:
            raise InvalidRequestError(f"{spec.param}: {exc}", param=spec.param) from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


def no_engine_error(reason: str) -> UnsupportedError:
    """The 400 for a constrained request that this engine cannot serve."""
    return UnsupportedError(f"structured output is not available: {reason}", param="structured_output")
