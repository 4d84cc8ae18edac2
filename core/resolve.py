"""Which plugin serves this: one rule for every such question, and the questions the core asks.

The rule (`choose`), the same for backends, chat templates, template renderers, reasoning and tool-call
parsers, vision processors, and any registry added later (a structured-output engine's, say):

1. An explicit choice (a flag or a config field) wins. A name nobody registered is an error that lists
   the registered names.
2. Otherwise the candidates that fit the question (the model's architecture, markers in its chat
   template, availability on this machine) are ordered by the question's stated rank, and the single
   best one wins.
3. No candidate, or several sharing the best rank, means none where the question is optional (an
   ambiguity is logged, naming the candidates) and a clear error where it is required. Import and
   registration order never decide.

The questions:

==================  =====================  ===========================================  =========
question            explicit choice        candidates, rank                             if none
==================  =====================  ===========================================  =========
backend             ``--backend``          available backends; priority, then name      error
chat template       ``--chat-template``    the model's own, else those registered for   none
                                           its architecture (flat)
template renderer   (none)                 plugins whose ``core_make_chat_template``    error
                                           renders the source (flat)
parsers             ``--*-parser``/none    registered for the architecture with every   none
                                           ``chat_template_contains`` marker (flat)
vision processor    (none)                 the one registered under the architecture    none
grammar engine      ``--structured-output  registered engines by priority (a tie: none)  none
                    -engine``
proposer            ``--speculative``      (explicit only)                              error
==================  =====================  ===========================================  =========

Only this module and core.plugins name the plugin host; the contract modules (backend, chat_template,
parsers, vision) know nothing of plugins.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from core.errors import PluginError, UnsupportedError
from core.registry import Entry, Registry

if TYPE_CHECKING:
    from core.backend import ModelInfo, Tokenizer
    from core.chat_template import ChatTemplate
    from core.plugins import PluginHost
    from core.vision import VisionProcessor

log = logging.getLogger(__name__)
T = TypeVar("T")
#: The flag value that turns a parser off (no automatic choice either).
NO_PARSER = "none"


class Ambiguous(PluginError):
    """Several candidates share the best rank of a required question."""


def _flat(candidate: Any) -> int:
    return 0


def choose(candidates: Iterable[T], *, name: Callable[[T], str], rank: Callable[[T], Any] = _flat,
           required: bool = False, question: str = "a plugin") -> T | None:
    """Steps 2 and 3 of the rule: the single best of `candidates` by `rank` (lower is better).

    :raises Ambiguous: when several share the best rank and `required`.
    :raises PluginError: when there is no candidate and `required`.
    """
    ordered = sorted(candidates, key=lambda c: (rank(c), name(c)))
    best = [c for c in ordered if rank(c) == rank(ordered[0])] if ordered else []
    if len(best) == 1:
        return best[0]
    if best:
        names = ", ".join(name(c) for c in best)
        if required:
            raise Ambiguous(f"several plugins fit {question} ({names}) and none is preferred")
        log.warning("several candidates fit %s (%s): none is chosen automatically; name one", question, names)
    elif required:
        raise PluginError(f"no installed plugin provides {question}")
    return None


def _entry_name(entry: Entry) -> str:
    return entry.name


# -- backends ----------------------------------------------------------------------------------------


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
    return sorted(choices, key=_backend_rank)


def _backend_rank(choice: BackendChoice) -> tuple[int, str]:
    return (-choice.priority, choice.name)  # names are unique: never a tie


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
    available = [c for c in choices if not c.unavailable_reason]
    if not available:
        reasons = "; ".join(f"{c.name}: {c.unavailable_reason}" for c in choices)
        raise PluginError(f"no installed backend can run here ({reasons})")
    best = choose(available, name=lambda c: c.name, rank=_backend_rank, required=True, question="a backend")
    assert best is not None
    return best.entry


# -- chat templates ----------------------------------------------------------------------------------


def resolve_chat_template(plugins: PluginHost, requested: str | None, model: ModelInfo,
                          tokenizer: Tokenizer | None) -> ChatTemplate | None:
    """The template to use: the user's choice (a file or a registered name), else the model's own, else
    the one built-in registered for the model's architecture (none when none or several are)."""
    if requested:
        if os.path.isfile(requested):
            with open(requested, encoding="utf-8") as f:
                return render_template_source(plugins, f.read(), tokenizer, requested)
        try:
            return plugins.chat_templates.get(requested).load()(tokenizer)
        except LookupError as exc:
            raise PluginError(f"--chat-template {requested!r} is neither a file nor a registered template: {exc}") from exc
    if model.chat_template:
        return render_template_source(plugins, model.chat_template, tokenizer, f"{model.name}'s own template")
    fitting = [e for e in plugins.chat_templates if model.architecture in e.meta.get("architectures", ())]
    entry = choose(fitting, name=_entry_name, question=f"the chat template of {model.architecture}")
    return entry.load()(tokenizer) if entry is not None else None


def render_template_source(plugins: PluginHost, source: str, tokenizer: Tokenizer | None,
                           what: str) -> ChatTemplate:
    """A ChatTemplate for template text, from the one plugin whose ``core_make_chat_template`` renders it."""
    answers = []
    for impl in plugins.hook.core_make_chat_template.get_hookimpls():
        template = impl.function(source=source, tokenizer=tokenizer)
        if template is not None:
            answers.append((impl.plugin_name, template))
    try:
        found = choose(answers, name=lambda answer: answer[0], required=True, question=f"rendering {what}")
    except Ambiguous as exc:
        raise PluginError(f"{exc}; keep one of them with CORE_PLUGINS") from None
    except PluginError:
        raise PluginError(
            f"no installed plugin can render {what}; install the templates plugin "
            "(pip install ./plugins/templates) or pass --chat-template NAME"
        ) from None
    assert found is not None
    return found[1]


# -- reasoning and tool-call parsers -----------------------------------------------------------------


def parser_entry(registry: Registry, requested: str | None, flag: str, architecture: str,
                 template_source: str | None) -> Entry | None:
    """The registered parser to use: the one `requested` names, none for "none", else the automatic choice.

    :raises PluginError: when `requested` names no registered parser (the message lists the registered ones).
    """
    if requested == NO_PARSER:
        return None
    if requested:
        entry = registry.find(requested)
        if entry is None:
            known = ", ".join(registry.names()) or "none registered; install the templates plugin"
            raise PluginError(f"{flag} {requested!r} is not a registered {registry.kind}; choose one of: "
                              f"{known} (or {NO_PARSER!r} to turn it off)")
        return entry
    return automatic_entry(registry, architecture, template_source)


def automatic_entry(registry: Registry, architecture: str, template_source: str | None) -> Entry | None:
    """The one parser registered for `architecture` whose template markers all occur in the chat template.

    A registration's ``architectures`` option lists the model architectures it fits; its optional
    ``chat_template_contains`` lists text that must appear in the chat template (several model families
    share an architecture; the template tells them apart). No match, or more than one, means no parser.
    """
    source = template_source or ""
    fitting = [entry for entry in registry
               if architecture in entry.meta.get("architectures", ())
               and all(marker in source for marker in entry.meta.get("chat_template_contains", ()))]
    return choose(fitting, name=_entry_name, question=f"the {registry.kind} of {architecture}")


# -- vision processors -------------------------------------------------------------------------------


def _vision_entry(plugins: PluginHost, architecture: str) -> Entry | None:
    fitting: Sequence[Entry] = [e for e in plugins.vision_processors if e.name == architecture]
    return choose(fitting, name=_entry_name, question=f"the vision processor of {architecture}")


def get_vision_processor(plugins: PluginHost, architecture: str, model_path: str) -> VisionProcessor:
    """The vision processor a plugin registered for `architecture`, built for `model_path`."""
    entry = _vision_entry(plugins, architecture)
    if entry is None:
        known = ", ".join(plugins.vision_processors.names()) or "none (install core-vl-models)"
        raise UnsupportedError(f"no vision processor for architecture {architecture!r}; known: {known}")
    return entry.load()(model_path)


def find_vision_processor(plugins: PluginHost, architecture: str, model_path: str | None) -> VisionProcessor | None:
    """The vision processor for a served checkpoint, or None for a text-only model (no processor
    registered for its architecture, or no checkpoint folder to build one from)."""
    if model_path is None or _vision_entry(plugins, architecture) is None:
        return None
    if not os.path.isdir(model_path):
        return None  # a GGUF file: no processor configuration to read
    return get_vision_processor(plugins, architecture, model_path)


# -- structured-output engines -----------------------------------------------------------------------


def _engine_rank(entry: Entry) -> int:
    return -int(entry.meta.get("priority", 0))


def structured_output_engine(plugins: PluginHost, requested: str | None) -> Entry | None:
    """The grammar engine named `requested`, else the registered one of highest priority (none when
    none is registered or several share the best priority).

    :raises PluginError: when `requested` names no registered engine (the message lists them).
    """
    registry = plugins.structured_output_engines
    if requested:
        entry = registry.find(requested)
        if entry is None:
            known = ", ".join(registry.names()) or "none registered; install the pytorch backend plugin"
            raise PluginError(f"--structured-output-engine {requested!r} is not registered; choose one of: {known}")
        return entry
    return choose(registry, name=_entry_name, rank=_engine_rank, question="the structured-output engine")


# -- speculative proposers ---------------------------------------------------------------------------


def speculative_proposer(plugins: PluginHost, requested: str) -> Entry:
    """The proposer registered as `requested` (``--speculative``: always an explicit choice).

    :raises PluginError: when no plugin registered it (the message lists those that are).
    """
    entry = plugins.speculative_proposers.find(requested)
    if entry is None:
        known = ", ".join(plugins.speculative_proposers.names()) or "none registered"
        raise PluginError(f"--speculative {requested!r} is not a registered proposer; choose one of: {known}")
    return entry
