"""An engine's parts from an EngineConfig: the backend, chat template, vision processor and structured-output
compiler that the resolver (core.resolve) picks for it, built once at start-up."""

from __future__ import annotations

import logging
from typing import Any

from core.backend import Backend
from core.config import EngineConfig
from core.errors import UnsupportedError
from core.openmp import release_openmp_pool
from core.structured_output import ConstraintCompiler

log = logging.getLogger(__name__)


def engine_parts(config: EngineConfig, plugins: Any = None) -> tuple[Backend, dict[str, Any]]:
    """The loaded backend and the keyword arguments of `AsyncEngine` over it."""
    from core.plugins import get_plugins
    from core.resolve import find_vision_processor, resolve_chat_template, select_backend

    plugins = plugins or get_plugins()
    backend = select_backend(plugins, config.backend).load()(config)
    if config.speculative is not None and not backend.supports_speculative_decoding:
        raise UnsupportedError(f"the {type(backend).__name__} backend does not do speculative decoding; "
                               "start without --speculative", param="speculative")
    template = resolve_chat_template(plugins, config.chat_template, backend.model_info, backend.tokenizer)
    vision = find_vision_processor(plugins, backend.model_info.architecture, config.model)
    constraints = constraint_compiler(plugins, backend, config.structured_output_engine)
    release_openmp_pool()  # loading is done on this thread; see core.openmp
    return backend, {
        "chat_template": template, "model_name": config.served_model_name, "vision": vision,
        "media_policy": config.media, "allow_special_tokens_in_content": config.allow_special_tokens_in_content,
        "model_aliases": config.served_model_aliases,
        "chat_template_content_format": config.chat_template_content_format, "constraints": constraints,
        "adapter_policy": config.adapters,
    }


def constraint_compiler(plugins: Any, backend: Backend, requested: str | None) -> ConstraintCompiler | str:
    """The structured-output compiler for `backend`'s tokenizer (its engine is loaded on first use, on a
    preparation thread), or why constrained requests are refused."""
    from core.resolve import structured_output_engine

    entry = structured_output_engine(plugins, requested)  # an unknown name fails at start-up
    if not backend.supports_structured_output:
        return f"the {type(backend).__name__} backend does not apply output constraints"
    if entry is None:
        return "no single structured-output engine is installed; name one with --structured-output-engine"
    log.info("structured output: engine %r from plugin %r", entry.name, entry.plugin)

    def factory(tokenizer: Any, vocab_size: int) -> Any:
        return entry.load()(tokenizer, vocab_size)

    return ConstraintCompiler(entry.name, factory, backend.tokenizer, backend.model_info.vocab_size)
