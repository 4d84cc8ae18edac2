"""Choosing a backend: by name, or the available backend with the highest priority.

Never by import order: ties on priority are broken by name, and the order is documented (see each
backend's `priority` in `core plugins`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.errors import PluginError
from core.registry import Entry

if TYPE_CHECKING:
    from core.plugins import PluginHost


@dataclass(frozen=True)
class BackendChoice:
    """One backend with its availability on this machine."""

    entry: Entry
    unavailable_reason: str | None

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def priority(self) -> int:
        return int(self.entry.meta.get("priority", 0))


def backend_choices(plugins: PluginHost) -> list[BackendChoice]:
    """Every registered backend, best first, with the reason it cannot run here (if any)."""
    choices = [BackendChoice(e, _availability(e)) for e in plugins.backends]
    return sorted(choices, key=lambda c: (-c.priority, c.name))


def _availability(entry: Entry) -> str | None:
    check = entry.meta.get("available")
    if check is None:
        return None
    try:
        return check()
    except Exception as exc:  # a broken check must not break `core plugins`
        return f"availability check failed: {exc}"


def select_backend(plugins: PluginHost, name: str | None) -> Entry:
    """The backend named `name` (which must be available), or the best available one."""
    choices = backend_choices(plugins)
    if not choices:
        raise PluginError("no backend is installed; install one, e.g. pip install ./plugins/pytorch_backend")
    if name is not None:
        for choice in choices:
            if choice.name == name:
                if choice.unavailable_reason:
                    raise PluginError(f"backend {name!r} is not available here: {choice.unavailable_reason}")
                return choice.entry
        known = ", ".join(c.name for c in choices)
        raise PluginError(f"no backend named {name!r}; installed: {known}")
    for choice in choices:
        if not choice.unavailable_reason:
            return choice.entry
    reasons = "; ".join(f"{c.name}: {c.unavailable_reason}" for c in choices)
    raise PluginError(f"no installed backend can run here ({reasons})")
