"""Every hook a plugin can implement, grouped by contract.

Plugins are modules (or objects) found through the ``core`` entry-point group and implement hooks
marked with ``core.hookimpl``. Registration hooks receive a ``register`` callback::

    register(name: str, target, *, override: bool = False, **options) -> None

``target`` is an object, a factory, or a lazy ``"module:attr"`` string; nothing that touches a GPU may be
imported at registration time. Registering a name another plugin already registered is an error that
names both plugins, unless ``override=True`` (used to replace a built-in on purpose). The options each
hook accepts are listed in its docstring; any other option is an error.

All hooks exist since version 0.1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from core.backend import Tokenizer
    from core.chat_template import ChatTemplate

PROJECT = "core"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[..., None]

# ---------------------------------------------------------------------------------------------------
# Backends and models (the stateless-generate, sessions and sleep contracts are the Backend class)
# ---------------------------------------------------------------------------------------------------


@hookspec
def core_register_backends(register: Register) -> None:
    """Register inference backends.

    :param register: ``register(name, factory, *, priority=0, available=None, description="")``.
        ``factory(config: EngineConfig) -> Backend`` (or a "module:attr" string naming it).
        ``available() -> str | None`` returns None when the backend can run here, else the reason it
        cannot; it must not import torch or initialise a GPU. When no backend is named, the available
        backend with the highest ``priority`` is used (ties broken by name, never import order).
    :returns: nothing; call ``register`` once per backend.
    """


@hookspec
def core_register_model_architectures(register: Register) -> None:
    """Register model implementations for a backend, keyed by the Hugging Face architecture name.

    :param register: ``register(architecture, target, *, backend)``: ``architecture`` as in a
        checkpoint's ``config.json`` (e.g. "LlamaForCausalLM"); ``target`` the model class or a
        "module:Class" string; ``backend`` the backend that runs it (e.g. "pytorch"). The backend
        documents the interface its model classes implement.
    :returns: nothing.
    """


# ---------------------------------------------------------------------------------------------------
# Prompts and responses: chat templates, reasoning and tool-call parsers
# ---------------------------------------------------------------------------------------------------


@hookspec
def core_register_chat_templates(register: Register) -> None:
    """Register named chat templates (selected with ``--chat-template NAME``).

    :param register: ``register(name, factory, *, architectures=())``: ``factory(tokenizer) ->
        ChatTemplate``. ``architectures`` lists the model architectures that use this template when
        the checkpoint ships none (when several templates list the model's, none is chosen).
    :returns: nothing.
    """


@hookspec
def core_make_chat_template(source: str, tokenizer: Tokenizer | None) -> ChatTemplate | None:
    """Build a ChatTemplate from template source text (a model's own Jinja template or a file).

    Every implementation is asked (core.resolve): exactly one may answer; several answers are an error
    naming the plugins (keep one with CORE_PLUGINS), never a matter of call order.

    :param source: the template text.
    :param tokenizer: the model's tokenizer (for bos/eos tokens), or None.
    :returns: a ChatTemplate, or None when this plugin cannot render that source.
    """


@hookspec
def core_register_reasoning_parsers(register: Register) -> None:
    """Register reasoning parsers that split model text into reasoning and content.

    :param register: ``register(name, factory, *, architectures=(), chat_template_contains=())``:
        ``factory(tokenizer) -> ReasoningParser``. When ``--reasoning-parser`` is not given, the server
        picks the one parser whose ``architectures`` include the model's and all of whose
        ``chat_template_contains`` strings occur in its chat template (none when several fit).
    :returns: nothing.
    """


@hookspec
def core_register_tool_call_parsers(register: Register) -> None:
    """Register tool-call parsers that turn model text into structured tool calls.

    :param register: ``register(name, factory, *, architectures=(), chat_template_contains=())``:
        ``factory(tokenizer) -> ToolCallParser``; chosen automatically like reasoning parsers (see
        ``core_register_reasoning_parsers``), and then used only for requests that send tools.
    :returns: nothing.
    """


# ---------------------------------------------------------------------------------------------------
# Structured output
# ---------------------------------------------------------------------------------------------------


@hookspec
def core_register_structured_output_engines(register: Register) -> None:
    """Register grammar engines that constrain generation (JSON schema, regex, choice, grammar).

    :param register: ``register(name, factory, *, priority=0, description="")``: ``factory(tokenizer,
        vocab_size) -> core.structured_output.StructuredOutputEngine`` (or a "module:attr" string naming
        it; it may import its engine then, never at registration). Without ``--structured-output-engine``,
        the engine with the highest ``priority`` serves (none when several share it).
    :returns: nothing.
    """


# ---------------------------------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------------------------------


@hookspec
def core_register_speculative_proposers(register: Register) -> None:
    """Register proposers of speculative decoding, chosen by name with ``--speculative NAME``.

    :param register: ``register(name, factory, *, description="")``: ``factory(config:
        core.speculative.SpeculativeConfig) -> core.speculative.Proposer`` (or a "module:attr" string
        naming it). A backend that speculates asks the proposer for draft tokens each step and verifies
        them with its model, so a proposer affects speed only, never the output's distribution.
    :returns: nothing.
    """


# ---------------------------------------------------------------------------------------------------
# Multimodal inputs
# ---------------------------------------------------------------------------------------------------


@hookspec
def core_register_vision_processors(register: Register) -> None:
    """Register vision processors, found by the checkpoint's architecture name.

    :param register: ``register(architecture, factory)``: ``factory(model_path) -> VisionProcessor``.
        A processor must not know which backend runs it.
    :returns: nothing.
    """


# ---------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------


@hookspec
def core_register_commands(register: Register) -> None:
    """Add sub-commands to the ``core`` command line.

    :param register: ``register(name, run, *, help="", configure=None)``: ``configure(parser)`` adds
        arguments to an ``argparse.ArgumentParser``; ``run(args) -> int | None`` executes the command
        and returns its exit status. Imports heavy modules inside ``run`` only, so ``core --help``
        stays fast and torch-free.
    :returns: nothing.
    """


# Options each registration hook's ``register`` accepts beyond ``override``; the scope key (if any)
# namespaces names, so two backends may both implement "LlamaForCausalLM".
_PARSER_OPTIONS = frozenset({"architectures", "chat_template_contains"})
_ENGINE_OPTIONS = frozenset({"priority", "description"})
REGISTRATION_HOOKS: dict[str, tuple[str, frozenset[str], str]] = {
    # hook name: (kind, allowed options, scope option)
    "core_register_backends": ("backend", frozenset({"priority", "available", "description"}), ""),
    "core_register_model_architectures": ("model architecture", frozenset(), "backend"),
    "core_register_chat_templates": ("chat template", frozenset({"architectures"}), ""),
    "core_register_reasoning_parsers": ("reasoning parser", _PARSER_OPTIONS, ""),
    "core_register_tool_call_parsers": ("tool-call parser", _PARSER_OPTIONS, ""),
    "core_register_vision_processors": ("vision processor", frozenset(), ""),
    "core_register_structured_output_engines": ("structured-output engine", _ENGINE_OPTIONS, ""),
    "core_register_speculative_proposers": ("speculative proposer", frozenset({"description"}), ""),
    "core_register_commands": ("command", frozenset({"help", "configure"}), ""),
}


def hook_names() -> list[str]:
    """Every hook specified here, for documentation checks."""
    return sorted(name for name, obj in globals().items() if name.startswith("core_") and callable(obj))


def describe(hook: str) -> dict[str, Any]:
    """The signature and docstring of one hook (used by meta-tests and docs)."""
    import inspect

    fn = globals()[hook]
    return {"name": hook, "signature": str(inspect.signature(fn)), "doc": inspect.getdoc(fn) or ""}
