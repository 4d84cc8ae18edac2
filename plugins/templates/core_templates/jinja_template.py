"""Hugging Face chat templates rendered in a sandbox, exactly as transformers' apply_chat_template does.

Templates from the Hub are untrusted code, so they run in jinja2's ImmutableSandboxedEnvironment with the
same globals and filters transformers provides (transformers/utils/chat_template_utils.py), and every value
the template sees is rebuilt from plain JSON types first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from core.chat_template import ChatTemplate, Message
from core.errors import InvalidRequestError
from core_templates.content_format import detect_content_format

# transformers copies a message's reasoning under these names; templates read the first (gpt-oss "thinking").
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
SENTINEL_USER = "CORE_SENTINEL_USER_7f3a"
SENTINEL_ASSISTANT = "CORE_SENTINEL_ASSISTANT_7f3a"


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` for templates without the class itself (no attribute access to type internals)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names, so templates cannot reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """Accepts transformers' `{% generation %}` blocks (used for assistant masks) and renders their body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """The sandboxed, compiled template (cached: servers render the same source for every request)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def plain(value: Any) -> Any:
    """`value` rebuilt from exact JSON types; anything else becomes an inert "<TypeName>" placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):  # subclasses (enums, numpy scalars) may carry unsafe methods
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Plain copies of the messages as transformers prepares them for a template.

    Keys whose value is None are dropped (OpenAI clients send content=None beside tool_calls, which many
    templates would render as "None"), reasoning is copied under every name templates read, and tool-call
    arguments sent as OpenAI JSON text become objects, which templates expect (vLLM does the same).
    """
    normalized = []
    for message in messages:
        message = {k: plain(v) for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_parse_arguments(call) for call in message["tool_calls"]]
        normalized.append(message)
    return normalized


def _parse_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def special_tokens(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's special tokens by name (bos_token, eos_token, ...), as transformers passes them."""
    if tokenizer is None:
        return {}
    mapping = getattr(tokenizer, "special_tokens_map", None)
    if isinstance(mapping, Mapping):
        return {str(k): plain(v) for k, v in mapping.items()}
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    return {n: getattr(tokenizer, n) for n in names if isinstance(getattr(tokenizer, n, None), str)}


class JinjaChatTemplate(ChatTemplate):
    """A Hugging Face chat template (Jinja source) rendered like transformers' apply_chat_template.

    :param source: the template text.
    :param tokenizer: supplies bos_token, eos_token and the other special tokens; may be None.
    """

    def __init__(self, source: str, tokenizer: Any = None) -> None:
        self.source = source
        self.template = compile_template(source)
        self.content_format = detect_content_format(source, self.template.environment)
        self.tokens = special_tokens(tokenizer)
        self.stop_strings = self._find_stop_strings()

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """The prompt; a final assistant message is continued when add_generation_prompt is False.
        `template_kwargs` become template variables (a "documents" list is passed as transformers does)."""
        chat = normalize_messages(messages)
        final = None if add_generation_prompt else self._mark_continuation(chat)
        try:
            rendered = self._render(chat, add_generation_prompt, tools, template_kwargs)
        except InvalidRequestError:
            if all("content" in message for message in chat):
                raise
            # a template that reads every message's content (SmolLM2's), given a turn of tool calls only:
            # its content as empty text, as vLLM renders it, rather than a 400
            chat = [{"content": "", **message} for message in chat]
            rendered = self._render(chat, add_generation_prompt, tools, template_kwargs)
        return rendered if final is None else _cut_continuation(rendered, final)

    def _render(self, chat: list[dict[str, Any]], add_generation_prompt: bool,
                tools: Sequence[Mapping[str, Any]] | None, template_kwargs: Mapping[str, Any]) -> str:
        kwargs = dict(template_kwargs)
        documents = kwargs.pop("documents", None)
        variables = {**self.tokens, **plain(kwargs)}  # the request's kwargs win, as in transformers
        try:
            return self.template.render(messages=chat, tools=plain(tools), documents=plain(documents),
                                        add_generation_prompt=add_generation_prompt, **variables)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError) as exc:
            # raise_exception() and type errors come from what the request sent (roles, tool ids, ...).
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}", param="messages") from exc

    def _mark_continuation(self, chat: list[dict[str, Any]]) -> str | None:
        """Append the continuation tag to the final assistant text; returns that text, or None when
        there is nothing to continue (no assistant last, no text, or a template that ignores content)."""
        if not chat or chat[-1].get("role") != "assistant" or "content" not in self.source:
            return None
        content = chat[-1].get("content")
        if isinstance(content, str):
            chat[-1]["content"] = content + CONTINUE_TAG
            return content
        for block in reversed(content if isinstance(content, list) else []):
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                block["text"], text = block["text"] + CONTINUE_TAG, block["text"]
                return text
        return None

    def _find_stop_strings(self) -> tuple[str, ...]:
        """The end-of-turn marker (what the template writes right after an assistant message) and eos."""
        probe = [{"role": "user", "content": SENTINEL_USER}, {"role": "assistant", "content": SENTINEL_ASSISTANT}]
        try:
            text = self._render(probe, False, None, {})
        except Exception:  # a template may reject the probe (roles, required system prompt): eos only
            text = ""
        after = text[text.rindex(SENTINEL_ASSISTANT) + len(SENTINEL_ASSISTANT):] if SENTINEL_ASSISTANT in text else ""
        marker = after.split()[0] if after.split() else ""
        eos = self.tokens.get("eos_token")
        stops = [s for s in (marker, eos) if isinstance(s, str) and s]
        return tuple(dict.fromkeys(stops))


def _cut_continuation(rendered: str, final: str) -> str:
    """Cut the prompt right after the final message's text, as transformers does."""
    tag = CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise InvalidRequestError(
            "the final assistant message cannot be continued: the chat template drops part of it",
            param="messages",
        )
    loc = rendered.rindex(tag)
    if rendered[loc:loc + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()  # the template trimmed the trailing space of the tag
