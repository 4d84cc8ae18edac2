"""core: a pluggable LLM-serving framework.

Public API: `pipeline()`, `Pipeline`, `AsyncEngine`, `GenerationConfig`, `EngineConfig`, `StructuredOutput`. Importing core
is cheap: it never imports torch; backends load lazily through plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["AsyncEngine", "EngineConfig", "GenerationConfig", "Pipeline", "StructuredOutput", "hookimpl", "pipeline",
           "__version__"]

from core.config import EngineConfig, GenerationConfig
from core.hookspecs import hookimpl
from core.structured_output import StructuredOutput

if TYPE_CHECKING:
    from core.engine import AsyncEngine
    from core.pipelines import Pipeline, pipeline

_LAZY = {"AsyncEngine": "core.engine", "Pipeline": "core.pipelines", "pipeline": "core.pipelines"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'core' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
