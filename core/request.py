"""What a request is on its way through the engine, and the rules that prepare one.

`RequestPreparer.prepare` turns user inputs (a prompt string, token ids, or OpenAI-style messages) plus a
GenerationConfig into a `PreparedRequest`: the rendered prompt text, token ids and limits the backend can
run, raising clear request errors. It runs on whatever thread calls it; core.preparation runs it on
worker threads. The removed interactive-mode keywords are rejected here by name.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from core.backend import ModelInfo, Tokenizer, TokenLogprob
from core.chat_template import ChatTemplate, validate_messages, validate_tools
from core.config import GenerationConfig
from core.content_format import AUTO, apply_content_format, resolve_content_format
from core.errors import ContextTooLongError, InvalidRequestError, UnsupportedError
from core.media import ImageSource, MediaPolicy, extract_images, load_images
from core.prompt_bound import TokenBound, token_bound
from core.session import Session
from core.special_tokens import ContentGuard
from core.structured_output import Constraint, ConstraintCompiler, StructuredOutput, no_engine_error
from core.vision import MultiModalInputs, VisionProcessor

REMOVED_KEYWORDS = ("sequence_start", "sequence_end", "step", "interactive")
# The same, as HTTP bodies spelled them (LMDeploy's interactive_mode).
REMOVED_HTTP_FIELDS = (*REMOVED_KEYWORDS, "interactive_mode")
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})
GENERATION_FIELDS = frozenset(f.name for f in fields(GenerationConfig))

Inputs = str | Sequence[int] | Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class RequestOutput:
    """One step of one choice: new text and tokens since the previous output of that choice.

    `completion_tokens` counts all tokens generated so far for this choice; `finish_reason` is set on
    its last output ("stop", "length", "abort"); `stop_reason` is the stop string or stop token id;
    `prompt_logprobs` (when the config asks for them) come once, with the request's first output.
    """

    session_id: str
    index: int
    text: str
    token_ids: Sequence[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: Sequence[TokenLogprob] | None = None
    prompt_logprobs: Sequence[TokenLogprob | None] | None = None  # on the request's first output only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready to run: prompt ids, resolved config and stopping rules, and what the response's
    postprocessors need (the prompt text as rendered, the tools and template switches it was rendered with).

    :param prompt_text: the prompt as text: a prompt string as given, chat messages as rendered ("" for
        token ids).
    :param session: the session opened when preparation started (`AsyncEngine.prepare`), so that aborts,
        stop_all and back-pressure reach a request still being prepared; None when `AsyncEngine.generate`
        prepares it itself.
    """

    prompt_token_ids: tuple[int, ...]
    config: GenerationConfig
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    multimodal: MultiModalInputs | None = None
    prompt_text: str = ""
    tools: Sequence[Mapping[str, Any]] | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    session: Session | None = field(default=None, compare=False, repr=False)
    constraint: Any = field(default=None, compare=False, repr=False)  # config.structured_output compiled


class Encoded(NamedTuple):
    """One request's prompt: token ids, text, whether it came from chat messages, its images' inputs."""

    token_ids: tuple[int, ...]
    text: str
    is_chat: bool
    multimodal: MultiModalInputs | None = None


def reject_removed_keywords(function: str, kwargs: Mapping[str, Any]) -> None:
    """TypeError naming any interactive-mode keyword, or any other unknown keyword."""
    for name in kwargs:
        if name in REMOVED_KEYWORDS:
            raise TypeError(
                f"{function}() got the removed keyword {name!r}: requests are stateless, so send the "
                "whole conversation with every request (prefix caching makes the repeat cheap)"
            )
    unknown = [name for name in kwargs if name not in GENERATION_FIELDS]
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")


def merge_config(config: GenerationConfig | None, overrides: Mapping[str, Any]) -> GenerationConfig:
    """`config` (or defaults) with keyword overrides applied and validated."""
    if config is not None and not isinstance(config, GenerationConfig):
        raise TypeError(f"config must be a GenerationConfig, got {type(config).__name__}")
    base = config or GenerationConfig()
    return base.replace(**overrides) if overrides else base


class RequestPreparer:
    """Tokenizes inputs and resolves limits against one model (shared by every request).

    Chat messages with images (OpenAI ``image_url`` parts, Anthropic ``image`` blocks) are rendered by
    the chat template, their images loaded under `media_policy` and handed with the text to the
    model's vision processor, whose expanded token ids become the prompt (so usage counts image
    tokens). A model without a vision processor refuses images with a request error.

    Control strings in message text stay text (core.special_tokens) unless
    `allow_special_tokens_in_content`; with images, where the vision processor tokenizes, they are refused.
    Message content reaches the template in `content_format` (core.content_format; "auto": the
    template's own).
    """

    def __init__(self, model: ModelInfo, tokenizer: Tokenizer, template: ChatTemplate | None,
                 vision: VisionProcessor | None = None, media_policy: MediaPolicy | None = None, *,
                 allow_special_tokens_in_content: bool = False, content_format: str = AUTO,
                 constraints: ConstraintCompiler | str | None = None) -> None:
        self.model = model
        # the structured-output compiler, or why this engine has none
        self.constraints = constraints
        self.tokenizer = tokenizer
        self.template = template
        self.content_format = resolve_content_format(content_format, template.content_format if template else AUTO)
        self.vision = vision
        self.media_policy = media_policy or MediaPolicy()
        self.template_stop_ids, self.template_stop_strings = self._split_template_stops()
        stops = template.stop_strings if template else ()
        self.guard = None if allow_special_tokens_in_content else ContentGuard(tokenizer, stops)

    def _split_template_stops(self) -> tuple[frozenset[int], tuple[str, ...]]:
        # An end-of-turn marker that is one token stops on the token; a longer one on its text.
        ids, strings = set(), []
        for text in self.template.stop_strings if self.template else ():
            encoded = self.tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == 1:
                ids.add(encoded[0])
            else:
                strings.append(text)
        return frozenset(ids), tuple(strings)

    def render(self, messages: Any, *, add_generation_prompt: bool = True, tools: Any = None,
               chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The chat prompt text for `messages`."""
        checked = validate_messages(messages)
        if self.template is None:
            raise InvalidRequestError(
                f"model {self.model.name!r} has no chat template; send a prompt instead of messages, "
                "or start the engine with --chat-template NAME|FILE",
                param="messages",
            )
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise InvalidRequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
        reserved = sorted(set(chat_template_kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved[0]!r}; it is a request field",
                                      param="chat_template_kwargs")
        checked = apply_content_format(checked, self.content_format)
        return self.template.render(checked, add_generation_prompt=add_generation_prompt,
                                    tools=validate_tools(tools), **dict(chat_template_kwargs or {}))

    def tokenize(self, inputs: Inputs, **render_options: Any) -> tuple[tuple[int, ...], bool]:
        """Prompt token ids (image placeholders expanded) and whether the inputs were chat messages."""
        encoded = self.encode(inputs, **render_options)
        return encoded.token_ids, encoded.is_chat

    def encode(self, inputs: Inputs, *, max_tokens: int | None = None, **render_options: Any) -> Encoded:
        """Prompt token ids and text, whether the inputs were chat messages, and their images' inputs. A text
        certainly longer than `max_tokens` tokens is refused before it is tokenized (`_refuse_if_too_long`)."""
        if isinstance(inputs, str):
            self._refuse_if_too_long(inputs, max_tokens)
            return Encoded(tuple(self.tokenizer.encode(inputs, add_special_tokens=True)), inputs, False)
        if is_message_list(inputs):
            rendered, sources = extract_images(validate_messages(inputs))
            if sources:
                return self._multimodal(rendered, sources, render_options)
            return self._encode_chat(inputs, render_options, max_tokens)
        if isinstance(inputs, Sequence) and inputs and all(_is_token(t) for t in inputs):
            self._check_token_ids(inputs, "prompt")
            return Encoded(tuple(inputs), "", False)
        raise InvalidRequestError(
            "the prompt must be a non-empty string, a list of token ids or a list of chat messages",
            param="prompt",
        )

    def _encode_chat(self, messages: Any, render_options: Mapping[str, Any], max_tokens: int | None) -> Encoded:
        """Rendered and tokenized; control strings in the messages' text stay text (the guard)."""
        tools, mark = validate_tools(render_options.get("tools")), None
        if self.guard is not None:
            (messages, tools), mark = self.guard.mark((messages, tools))
        text = self.render(messages, **{**render_options, "tools": tools})
        self._refuse_if_too_long(text, max_tokens, ignored=mark or "", param="messages")
        add_special = self.template is not None and self.template.encode_with_special_tokens
        ids = tuple(ContentGuard.encode(self.tokenizer, text, mark, add_special))
        return Encoded(ids, text.replace(mark, "") if mark else text, True)

    @functools.cached_property
    def token_bound(self) -> TokenBound | None:
        """The tokenizer's least tokens for a text (core.prompt_bound), read once, when a text first needs it."""
        return token_bound(self.tokenizer)

    def _refuse_if_too_long(self, text: str, max_tokens: int | None, ignored: str = "",
                            param: str = "prompt") -> None:
        """ContextTooLongError (naming `param`: chat messages' is "messages") for a text that cannot be
        `max_tokens` tokens or fewer, told without tokenizing it (`ignored`: characters removed before
        tokenizing). A text it lets pass may still be too long."""
        if max_tokens is None or len(text) <= max_tokens or self.token_bound is None:
            return  # (the bound is never above the text's length)
        least = self.token_bound.min_tokens(text, ignored)
        if least > max_tokens:
            raise ContextTooLongError(
                f"the prompt has at least {least} tokens ({len(text)} characters) but the model's context window "
                f"is {self.model.max_model_len} tokens and at least one token must be generated; shorten the prompt",
                param=param,
            )

    def _multimodal(self, rendered: list[dict[str, Any]], sources: list[ImageSource],
                    render_options: Mapping[str, Any]) -> Encoded:
        if self.vision is None:
            raise InvalidRequestError(
                f"{sources[0].field} is an image, but model {self.model.name!r} ({self.model.architecture}) "
                "is a text-only model and does not accept images", param=sources[0].field)
        control = self.guard.found_in((rendered, render_options.get("tools"))) if self.guard else None
        if control is not None:
            raise InvalidRequestError(
                f"the messages hold the control string {control!r}; with images this server does not accept "
                "control strings in message text", param="messages")
        images = load_images(sources, self.media_policy)  # already decoded when core.preparation loaded them
        text = self.render(rendered, **render_options)
        multimodal = self.vision.preprocess(text, images)
        return Encoded(tuple(multimodal.prompt_token_ids), text, True, multimodal)

    def _check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        vocab = self.model.vocab_size
        for t in token_ids:
            if t < 0 or (vocab and t >= vocab):
                raise InvalidRequestError(f"{param}: token id {t} is outside the vocabulary [0, {vocab})",
                                          param=param)

    def prepare(self, inputs: Inputs, config: GenerationConfig, **render_options: Any) -> PreparedRequest:
        """Everything the backend needs, or a clear request error."""
        # a prompt that cannot fit is refused before it is tokenized, unless it is to be truncated
        longest = self.model.max_model_len - 1 if config.truncate_prompt_tokens is None else None
        encoded = self._truncated(self.encode(inputs, max_tokens=longest, **render_options),
                                  config.truncate_prompt_tokens)
        prompt = encoded.token_ids
        if not prompt:
            raise InvalidRequestError("the prompt is empty after tokenization", param="prompt")
        max_new = self._max_new_tokens(len(prompt), config, "messages" if encoded.is_chat else "prompt")
        self._check_logit_bias(config)
        self._check_token_ids(config.stop_token_ids, "stop_token_ids")  # banned before min_new_tokens
        self._check_token_ids(config.allowed_token_ids or (), "allowed_token_ids")
        config = config.with_defaults(self.model.generation_defaults)
        stop_ids = set(config.stop_token_ids)
        if not config.ignore_eos:
            stop_ids |= set(self.model.eos_token_ids) | self.template_stop_ids
        strings = config.stop + (self.template_stop_strings if encoded.is_chat and not config.ignore_eos else ())
        return PreparedRequest(prompt, config, max_new, frozenset(stop_ids), strings, encoded.multimodal,
                               encoded.text, render_options.get("tools"), _template_kwargs(render_options),
                               constraint=self._compile(config.structured_output))

    def _truncated(self, encoded: Encoded, keep: int | None) -> Encoded:
        """The prompt's last `keep` tokens (-1: the context window's size), its text decoded from them."""
        if keep is None:
            return encoded
        keep = self.model.max_model_len if keep == -1 else keep
        if len(encoded.token_ids) <= keep:
            return encoded
        if encoded.multimodal is not None:
            raise UnsupportedError(f"truncate_prompt_tokens ({keep}) would cut a prompt that holds images",
                                   param="truncate_prompt_tokens")
        ids = encoded.token_ids[-keep:]
        return encoded._replace(token_ids=ids, text=self.tokenizer.decode(list(ids)))

    def _compile(self, spec: StructuredOutput | None) -> Constraint | None:
        """The request's constraint compiled (once per distinct spec), on the preparing thread."""
        if spec is None:
            return None
        if not isinstance(self.constraints, ConstraintCompiler):
            raise no_engine_error(self.constraints or "no structured-output engine is installed")
        return self.constraints.compile(spec)

    def _check_logit_bias(self, config: GenerationConfig) -> None:
        # A backend would fail the whole batch step on an id outside its vocabulary.
        vocab = self.model.vocab_size
        outside = [t for t in config.logit_bias if vocab and t >= vocab]
        if outside:
            raise InvalidRequestError(f"logit_bias token id {outside[0]} is outside the vocabulary [0, {vocab})",
                                      param="logit_bias")

    def _max_new_tokens(self, prompt_len: int, config: GenerationConfig, prompt_param: str) -> int:
        window = self.model.max_model_len
        if prompt_len >= window:
            raise ContextTooLongError(
                f"the prompt has {prompt_len} tokens but the model's context window is {window} tokens "
                "and at least one token must be generated; shorten the prompt",
                param=prompt_param,
            )
        room = window - prompt_len
        if config.max_new_tokens is not None and config.max_new_tokens > room:
            raise ContextTooLongError(
                f"the context window is {window} tokens: the prompt has {prompt_len}, so max_new_tokens "
                f"can be at most {room}, got {config.max_new_tokens}",
                param="max_new_tokens",
            )
        if config.min_new_tokens > room:
            raise ContextTooLongError(
                f"min_new_tokens {config.min_new_tokens} does not fit the {room} tokens left in the "
                "context window",
                param="min_new_tokens",
            )
        return config.max_new_tokens if config.max_new_tokens is not None else room


def is_message_list(inputs: Any) -> bool:
    """Whether ``inputs`` are chat messages (a non-empty list of mappings) rather than a prompt."""
    return isinstance(inputs, Sequence) and not isinstance(inputs, str) and bool(inputs) \
        and all(isinstance(m, Mapping) for m in inputs)


def _template_kwargs(render_options: Mapping[str, Any]) -> dict[str, Any]:
    kwargs = render_options.get("chat_template_kwargs")
    return dict(kwargs) if isinstance(kwargs, Mapping) else {}


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
