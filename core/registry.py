"""Named registries filled through the registration hooks.

Every registration hook receives a `register(name, target, *, override=False, **meta)` callback bound to
the calling plugin, so validation, de-duplication and conflict reports live here, once. Targets may be
objects, factories, or lazy "module:attr" strings (so nothing touches CUDA or imports torch until used).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from core.errors import PluginError


def import_target(target: str) -> Any:
    """The object a ``"module:attr"`` (or ``"module:attr.sub"``) string names, imported; a plain
    ``"module"`` is the module.

    :raises ImportError, AttributeError: when it names nothing importable.
    """
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class Entry:
    """One registered item: a name, what it points to, which plugin registered it, and metadata."""

    kind: str
    name: str
    target: Any
    plugin: str
    scope: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        return (self.scope, self.name)

    def load(self) -> Any:
        """The target, importing it first when it is a "module:attr" string."""
        if not isinstance(self.target, str):
            return self.target
        try:
            return import_target(self.target)
        except (ImportError, AttributeError) as exc:
            raise PluginError(
                f"{self.kind} {self.name!r} from plugin {self.plugin!r} points to "
                f"{self.target!r}, which cannot be loaded: {exc}"
            ) from exc

    def describe(self) -> str:
        where = f" for {self.scope}" if self.scope else ""
        return f"{self.kind} {self.name!r}{where}"


class Registry:
    """Entries of one kind, keyed by (scope, name); a second registration of a key is a conflict."""

    def __init__(self, kind: str, allowed_meta: frozenset[str] = frozenset(), scoped_by: str = ""):
        self.kind = kind
        self.allowed_meta = allowed_meta
        self.scoped_by = scoped_by
        self._entries: dict[tuple[str, str], Entry] = {}

    def register_for(self, plugin: str) -> Callable[..., None]:
        """The `register` callback handed to `plugin`'s registration hook."""

        def register(name: str, target: Any, *, override: bool = False, **meta: Any) -> None:
            self.add(self._make_entry(plugin, name, target, meta), override=override)

        register.__doc__ = f"Register a {self.kind} for plugin {plugin!r}."
        return register

    def _make_entry(self, plugin: str, name: str, target: Any, meta: dict[str, Any]) -> Entry:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r} registered a {self.kind} with an empty or non-string name")
        if target is None:
            raise PluginError(f"plugin {plugin!r} registered {self.kind} {name!r} without a target")
        unknown = set(meta) - self.allowed_meta - {self.scoped_by}
        if unknown:
            raise PluginError(
                f"plugin {plugin!r} passed unknown option(s) {sorted(unknown)} for {self.kind} {name!r}; "
                f"allowed: {sorted(self.allowed_meta | ({self.scoped_by} - {''}))}"
            )
        scope = str(meta.pop(self.scoped_by, "")) if self.scoped_by else ""
        return Entry(self.kind, name, target, plugin, scope, meta)

    def add(self, entry: Entry, *, override: bool = False) -> None:
        """Add `entry`; a clash is an error naming both plugins unless the newcomer overrides."""
        existing = self._entries.get(entry.key)
        if existing is not None and not override:
            raise PluginError(
                f"{entry.describe()} is registered by both plugin {existing.plugin!r} and plugin "
                f"{entry.plugin!r}; uninstall one, disable it with CORE_PLUGINS, or pass override=True"
            )
        self._entries[entry.key] = entry

    def get(self, name: str, scope: str = "") -> Entry:
        """The entry called `name`; a LookupError listing what exists otherwise."""
        entry = self._entries.get((scope, name))
        if entry is None:
            known = ", ".join(sorted(e.name for e in self._entries.values() if e.scope == scope))
            where = f" for {scope}" if scope else ""
            raise LookupError(f"no {self.kind} named {name!r}{where}; known: {known or 'none'}")
        return entry

    def find(self, name: str, scope: str = "") -> Entry | None:
        return self._entries.get((scope, name))

    def in_scope(self, scope: str) -> dict[str, Entry]:
        """Entries of one scope by name (e.g. the architectures of one backend)."""
        return {e.name: e for e in self._entries.values() if e.scope == scope}

    def names(self) -> list[str]:
        return sorted(e.name for e in self._entries.values())

    def __iter__(self) -> Iterator[Entry]:
        return iter(sorted(self._entries.values(), key=lambda e: e.key))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return any(e.name == name for e in self._entries.values())
