"""The plugin host: loads the ``core`` entry-point group once and builds the registries.

``CORE_PLUGINS`` is an allow-list: unset loads every installed plugin, a comma-separated list loads only
those (entry-point or distribution names), and the empty string loads none. ``CORE_EXTRA_PLUGINS`` names
modules (comma-separated import paths) to load as plugins without installing them, like pytest's ``-p``. A plugin whose import fails
is logged, reported by ``core plugins`` and skipped; a plugin that implements a hook that does not exist
(a misspelt name) or with wrong arguments is an error naming the plugin and the hook.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from core import hookspecs
from core.errors import PluginError
from core.registry import Registry

log = logging.getLogger(__name__)
ENTRY_POINT_GROUP = "core"
ALLOW_LIST_VARIABLE = "CORE_PLUGINS"
EXTRA_PLUGINS_VARIABLE = "CORE_EXTRA_PLUGINS"


@dataclass(frozen=True)
class PluginInfo:
    """What `core plugins` reports for one plugin."""

    name: str
    distribution: str | None
    version: str | None
    hooks: tuple[str, ...]


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded, and why."""

    name: str
    distribution: str | None
    error: str


@dataclass
class PluginHost:
    """The loaded plugins, their hooks, and registries built from the registration hooks."""

    manager: pluggy.PluginManager
    failures: list[PluginFailure] = field(default_factory=list)
    _distributions: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    _registries: dict[str, Registry] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def hook(self) -> Any:
        return self.manager.hook

    def register(self, plugin: object, name: str | None = None) -> str:
        """Register an extra plugin object (tests, embedding applications); rebuilds registries."""
        registered = self.manager.register(plugin, name=name)
        if registered is None:
            raise PluginError(f"plugin {name or plugin!r} is already registered")
        _check_hook_names(self.manager, registered)
        self._registries = None
        return registered

    def unregister(self, name: str) -> None:
        """Remove a plugin registered by name; registries are rebuilt on next use."""
        self.manager.unregister(name=name)
        self._registries = None

    def registry(self, hook_name: str) -> Registry:
        """The registry filled by one registration hook (see hookspecs.REGISTRATION_HOOKS)."""
        with self._lock:
            if self._registries is None:
                self._registries = {name: self._build(name) for name in hookspecs.REGISTRATION_HOOKS}
            return self._registries[hook_name]

    @property
    def backends(self) -> Registry:
        return self.registry("core_register_backends")

    @property
    def model_architectures(self) -> Registry:
        return self.registry("core_register_model_architectures")

    @property
    def chat_templates(self) -> Registry:
        return self.registry("core_register_chat_templates")

    @property
    def reasoning_parsers(self) -> Registry:
        return self.registry("core_register_reasoning_parsers")

    @property
    def tool_call_parsers(self) -> Registry:
        return self.registry("core_register_tool_call_parsers")

    @property
    def vision_processors(self) -> Registry:
        return self.registry("core_register_vision_processors")

    @property
    def structured_output_engines(self) -> Registry:
        return self.registry("core_register_structured_output_engines")

    @property
    def speculative_proposers(self) -> Registry:
        return self.registry("core_register_speculative_proposers")

    @property
    def commands(self) -> Registry:
        return self.registry("core_register_commands")

    def _build(self, hook_name: str) -> Registry:
        kind, options, scope = hookspecs.REGISTRATION_HOOKS[hook_name]
        registry = Registry(kind, options, scope)
        # Call each implementation on its own so every registration is attributed to its plugin,
        # in registration order (so "registered by both A and B" reads in install order).
        for impl in getattr(self.manager.hook, hook_name).get_hookimpls():
            impl.function(register=registry.register_for(impl.plugin_name))
        return registry

    def info(self) -> list[PluginInfo]:
        """Name, distribution, version and implemented hooks of every loaded plugin."""
        result = []
        for name, plugin in sorted(self.manager.list_name_plugin(), key=lambda np: np[0]):
            if plugin is None:
                continue
            hooks = tuple(sorted(c.name for c in self.manager.get_hookcallers(plugin) or ()))
            dist, version = self._distributions.get(name, (None, None))
            result.append(PluginInfo(name, dist, version, hooks))
        return result


def _new_manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    return manager


def _allow_list(value: str | None) -> set[str] | None:
    if value is None:
        return None
    return {part.strip() for part in value.split(",") if part.strip()}


def _check_hook_names(manager: pluggy.PluginManager, plugin_name: str) -> None:
    """A hook implementation with no specification is almost always a typo: fail loudly."""
    plugin = manager.get_plugin(plugin_name)
    known = hookspecs.hook_names()
    for caller in manager.get_hookcallers(plugin) or ():
        if caller.spec is None:
            manager.unregister(name=plugin_name)
            close = difflib.get_close_matches(caller.name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise PluginError(f"plugin {plugin_name!r} implements unknown hook {caller.name!r}{hint}")


def _load_entry_point(host: PluginHost, ep: importlib.metadata.EntryPoint) -> None:
    dist = ep.dist.name if ep.dist else None
    try:
        module = ep.load()
    except Exception as exc:  # a broken plugin must not take the host down
        log.warning("plugin %r (%s) failed to import and was skipped: %s", ep.name, dist, exc)
        host.failures.append(PluginFailure(ep.name, dist, f"{type(exc).__name__}: {exc}"))
        return
    try:
        host.manager.register(module, name=ep.name)
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {ep.name!r} ({dist}) has an invalid hook implementation: {exc}") from exc
    host._distributions[ep.name] = (dist, ep.dist.version if ep.dist else None)
    _check_hook_names(host.manager, ep.name)


def load_plugins(allow: str | None = None, *, use_environment: bool = True,
                 extra: Iterable[object] = ()) -> PluginHost:
    """Load the installed plugins (honouring the allow-list) plus `extra` plugin objects."""
    if allow is None and use_environment:
        allow = os.environ.get(ALLOW_LIST_VARIABLE)
    allowed = _allow_list(allow)
    host = PluginHost(_new_manager())
    seen: set[str] = set()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist else None
        if ep.name in seen or (allowed is not None and not allowed & {ep.name, dist}):
            continue
        seen.add(ep.name)
        _load_entry_point(host, ep)
    if use_environment:
        _load_extra_modules(host, os.environ.get(EXTRA_PLUGINS_VARIABLE, ""))
    for plugin in extra:
        host.register(plugin)
    return host


def _load_extra_modules(host: PluginHost, names: str) -> None:
    for name in (n.strip() for n in names.split(",")):
        if not name:
            continue
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            raise PluginError(f"{EXTRA_PLUGINS_VARIABLE} names module {name!r}, which fails to import: {exc}") from exc
        host.register(module, name=name)


_host: PluginHost | None = None
_host_lock = threading.Lock()


def get_plugins() -> PluginHost:
    """The process-wide plugin host, loaded once on first use."""
    global _host
    with _host_lock:
        if _host is None:
            _host = load_plugins()
        return _host
