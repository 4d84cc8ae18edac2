"""LoRA adapters: the engine-wide policy, the names of adapters and the record of one loaded adapter.

Torch-free. A request chooses an adapter by name (`GenerationConfig.adapter`; over HTTP, the `model`
field naming it); a backend that serves adapters declares `Backend.supports_adapters` and keeps the
`AdapterRegistry` of the ones it has loaded. What an adapter folder holds is the backend's concern
(the pytorch backend reads PEFT folders: core_pytorch_backend/lora/).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import InvalidRequestError, ModelNotFoundError

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


@dataclass(frozen=True)
class LoraModule:
    """An adapter to load: the name requests use and its folder."""

    name: str
    path: str

    def __post_init__(self) -> None:
        check_adapter_name(self.name)
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise InvalidRequestError(f"lora_path must be a folder, got {self.path!r}", param="lora_path")
        object.__setattr__(self, "path", str(self.path))


def check_adapter_name(name: Any, param: str = "lora_name") -> str:
    """`name`, or a 400 naming `param`: letters, digits and ``._:/-``, at most 128 characters."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise InvalidRequestError(f"{param} must be 1-128 letters, digits or ._:/- (not starting with one "
                                  f"of those), got {name!r}", param=param)
    return name


def parse_lora_modules(items: Iterable[str | LoraModule | Mapping[str, str]] | Mapping[str, str]) -> tuple[LoraModule, ...]:
    """`--lora-modules name=path ...`, LoraModules, {"name": ..., "path": ...} or one {name: path} mapping."""
    if isinstance(items, Mapping):
        items = [LoraModule(str(name), path) for name, path in items.items()]
    modules = [_one_module(item) for item in items]
    seen: set[str] = set()
    for module in modules:
        if module.name in seen:
            raise InvalidRequestError(f"the adapter name {module.name!r} is given twice", param="lora_modules")
        seen.add(module.name)
    return tuple(modules)


def _one_module(item: str | LoraModule | Mapping[str, str]) -> LoraModule:
    if isinstance(item, LoraModule):
        return item
    if isinstance(item, Mapping):
        return LoraModule(item.get("name", ""), item.get("path", ""))
    name, sep, path = str(item).partition("=")
    if not sep:
        raise InvalidRequestError(f"a LoRA module is name=path, got {item!r}", param="lora_modules")
    return LoraModule(name.strip(), path.strip())


@dataclass(frozen=True)
class AdapterPolicy:
    """Which adapters an engine serves and how many it keeps ready.

    :param lora_modules: loaded at start-up (a bad one stops start-up).
    :param max_loras: adapters resident in the backend's slots at once (others wait on host, LRU).
    :param max_lora_rank: the largest rank accepted (slots are sized for it).
    :param runtime_loading: allow `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (off by default).
    :param allowed_paths: folders under which runtime loading may read; empty allows none.
    """

    lora_modules: tuple[LoraModule, ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 16
    runtime_loading: bool = False
    allowed_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", parse_lora_modules(self.lora_modules))
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
                raise InvalidRequestError(f"{name} must be an integer between 1 and 1024, got {value!r}", param=name)
        if isinstance(self.allowed_paths, (str, os.PathLike)):
            object.__setattr__(self, "allowed_paths", (str(self.allowed_paths),))
        object.__setattr__(self, "allowed_paths", tuple(str(p) for p in self.allowed_paths))

    @property
    def enabled(self) -> bool:
        """Whether this engine serves adapters at all."""
        return bool(self.lora_modules) or self.runtime_loading

    def check_runtime_path(self, path: str) -> str:
        """`path` resolved, or a 400 naming lora_path: runtime loading is off, or the folder is outside
        every allowed path (symbolic links are resolved first, so none leads out)."""
        if not self.runtime_loading:
            raise InvalidRequestError("runtime LoRA loading is off; start the server with "
                                      "--enable-runtime-lora (and --allowed-lora-path)", param="lora_path")
        resolved = Path(path).resolve()
        for allowed in self.allowed_paths:
            if resolved.is_relative_to(Path(allowed).resolve()):
                return str(resolved)
        raise InvalidRequestError(f"lora_path {path!r} is outside every --allowed-lora-path", param="lora_path")


@dataclass(frozen=True)
class AdapterInfo:
    """One loaded adapter. `key` is unique per load (a reload under the same name gets another), so
    KV computed through one load is never reused by another."""

    name: str
    path: str
    rank: int
    key: str


class AdapterRegistry:
    """The adapters a backend has loaded, by name; thread-safe (the engine loop and the server read it)."""

    def __init__(self) -> None:
        self._adapters: dict[str, AdapterInfo] = {}
        self._lock = threading.Lock()
        self._loads = 0

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def names(self) -> tuple[str, ...]:
        return tuple(self._adapters)

    def all(self) -> tuple[AdapterInfo, ...]:
        return tuple(self._adapters.values())

    def get(self, name: str) -> AdapterInfo:
        """The adapter, or a 404 naming the model field."""
        info = self._adapters.get(name)
        if info is None:
            raise ModelNotFoundError(f"no LoRA adapter {name!r} is loaded", param="model")
        return info

    def reserve_key(self, name: str) -> str:
        """A fresh key for loading `name`; a 400 if the name is taken."""
        with self._lock:
            if name in self._adapters:
                raise InvalidRequestError(f"an adapter named {name!r} is already loaded", param="lora_name")
            self._loads += 1
            return f"lora:{name}:{self._loads}"

    def add(self, info: AdapterInfo) -> None:
        with self._lock:
            if info.name in self._adapters:
                raise InvalidRequestError(f"an adapter named {info.name!r} is already loaded", param="lora_name")
            self._adapters[info.name] = info

    def remove(self, name: str) -> AdapterInfo:
        with self._lock:
            info = self._adapters.pop(name, None)
        if info is None:
            raise ModelNotFoundError(f"no LoRA adapter {name!r} is loaded", param="lora_name")
        return info
