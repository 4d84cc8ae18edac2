"""Validated configuration objects: GenerationConfig (per request) and EngineConfig (per engine).

Both validate on construction and raise `InvalidRequestError` (a ValueError) naming the field and the bad
value, so the same check serves Python callers (an exception naming the argument) and the HTTP server
(a 400 naming the field).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from core.adapters import AdapterPolicy, check_adapter_name
from core.content_format import AUTO, check_content_format
from core.errors import InvalidRequestError
from core.media import MediaPolicy
from core.speculative import SpeculativeConfig
from core.structured_output import StructuredOutput

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOP_LOGPROBS = 20
MAX_N = 128
# How weights are kept: auto (a GGUF file's quantized tensors stay packed on the CPU), none (dequantized),
# int8 / int4 (a float checkpoint quantized at load). Backends document what they support.
QUANTIZATIONS = ("auto", "none", "int8", "int4")

# Fallbacks for sampling fields left unset by both the request and the model's generation_config.json.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def _fail(name: str, value: Any, expected: str) -> InvalidRequestError:
    return InvalidRequestError(f"{name} must be {expected}, got {value!r}", param=name)


def _check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, value, "an integer")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f">= {low}"
        raise _fail(name, value, f"an integer {bounds}")


def _check_request_int(name: str, value: Any, low: int, high: int = INT64_MAX) -> None:
    # Request integers reach backends as int64 tensors: a larger one would fail the whole batch step.
    _check_int(name, value, low, high)


def _check_float(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise _fail(name, value, "a number")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise _fail(name, value, f"in {bracket}{low}, {high}]")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _fail(name, value, "true or false")


@dataclass(frozen=True)
class GenerationConfig:
    """How to generate for one request; the fields users of vLLM and LMDeploy expect.

    Sampling fields left as None take the model's generation_config.json value, else SAMPLING_DEFAULTS
    (see `with_defaults`). temperature 0 means greedy. max_new_tokens None means "until the context
    window is full". prompt_logprobs k (None: off) asks for the logprob of every prompt token and its k
    likeliest alternatives (the backend must support it; such a request does not read the prefix cache).
    structured_output constrains the output (a JSON schema, regex, choice or grammar; see
    core.structured_output); logprobs still report the model's own distribution, before the constraint.
    adapter names a loaded LoRA adapter to run the request through (None: the base model; the backend
    must support adapters, core.adapters). speculative False opts the request out of speculative
    decoding (core.speculative) where the engine speculates; it never changes greedy output.
    allowed_token_ids (vLLM's) are the only tokens sampled; truncate_prompt_tokens k keeps the prompt's
    last k tokens (-1: the context window's size), as vLLM does.
    """

    n: int = 1
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutput | None = None
    adapter: str | None = None
    speculative: bool = True
    allowed_token_ids: tuple[int, ...] | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        self._normalise_sequences()
        self._validate_counts()
        self._validate_sampling()
        self._validate_stops()
        self._validate_flags()

    def _normalise_sequences(self) -> None:
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)):
            raise _fail("stop", stop, "a string or a list of strings")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise _fail("stop_token_ids", ids, "a list of token ids")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (list, tuple)) or not allowed:
                raise _fail("allowed_token_ids", allowed, "a non-empty list of token ids")
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))

    def _validate_counts(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        if self.max_new_tokens is not None:
            _check_request_int("max_new_tokens", self.max_new_tokens, 1)
        _check_request_int("min_new_tokens", self.min_new_tokens, 0)
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise InvalidRequestError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens "
                f"({self.max_new_tokens})",
                param="min_new_tokens",
            )
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN, INT64_MAX)
        _check_int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.truncate_prompt_tokens is not None:
            _check_request_int("truncate_prompt_tokens", self.truncate_prompt_tokens, -1)
            if self.truncate_prompt_tokens == 0:
                raise _fail("truncate_prompt_tokens", 0, "a positive number of tokens, or -1")

    def _validate_sampling(self) -> None:
        if self.temperature is not None:
            _check_float("temperature", self.temperature, 0.0, 1e4)
        if self.top_p is not None:
            _check_float("top_p", self.top_p, 0.0, 1.0)  # 0: the top token alone (as OpenAI and HF take it)
        if self.top_k is not None:
            _check_request_int("top_k", self.top_k, -1)
        if self.min_p is not None:
            _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.repetition_penalty is not None:
            _check_float("repetition_penalty", self.repetition_penalty, 0.0, 1e4, low_open=True)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not isinstance(self.logit_bias, Mapping):
            raise _fail("logit_bias", self.logit_bias, "a mapping of token id to bias")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= INT64_MAX:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {token!r}", param="logit_bias")
            _check_float(f"logit_bias[{token}]", bias, -100.0, 100.0)

    def _validate_stops(self) -> None:
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _fail("stop", s, "a non-empty string")
        for t in self.stop_token_ids:
            _check_request_int("stop_token_ids", t, 0)
        for t in self.allowed_token_ids or ():
            _check_request_int("allowed_token_ids", t, 0)

    def _validate_flags(self) -> None:
        for name in ("ignore_eos", "logprobs", "skip_special_tokens", "include_stop_str_in_output", "speculative"):
            _check_bool(name, getattr(self, name))
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=True", param="top_logprobs")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise _fail("structured_output", self.structured_output, "a core.StructuredOutput")
        if self.adapter is not None:
            check_adapter_name(self.adapter, "adapter")

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (after defaults were applied)."""
        return self.temperature == 0.0

    def with_defaults(self, model_defaults: Mapping[str, Any] | None = None) -> GenerationConfig:
        """Fill unset sampling fields from the model's generation config, then SAMPLING_DEFAULTS."""
        model_defaults = model_defaults or {}
        filled = {}
        for name, fallback in SAMPLING_DEFAULTS.items():
            if getattr(self, name) is None:
                value = model_defaults.get(name)
                filled[name] = fallback if value is None else value
        return dataclasses.replace(self, **filled) if filled else self

    def replace(self, **changes: Any) -> GenerationConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> GenerationConfig:
        """Build from a mapping, rejecting unknown keys by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequestError(f"unknown generation parameter {unknown[0]!r}", param=unknown[0])
        return cls(**values)


@dataclass(frozen=True)
class EngineConfig:
    """How to build an engine: which model, which backend, and the memory and batching limits.

    :param model: a Hugging Face folder or a .gguf file; None serves the backend's default model.
    :param quantization: one of QUANTIZATIONS: how the backend keeps the weights.
    :param backend: a registered backend name; None picks the best available one by priority.
    :param kv_cache_memory_gib: absolute KV-cache budget; None lets the backend choose (the pytorch
        backend: a fraction of free GPU memory, a fixed default on the CPU).
    :param backend_options: options only a particular backend understands, validated and documented by
        it (the pytorch backend's GPU knobs: ``enforce_eager``, ``kv_cache_memory_fraction``).
    :param media: where request images may come from and how large they may be (vision models).
    :param allow_special_tokens_in_content: let control strings in message text (``<|im_end|>``)
        become control tokens; off by default, so a client cannot forge turns (core.special_tokens).
    :param served_model_name: the name clients use; a list gives several names, the first reported in
        responses and the others accepted as aliases (it is then split into this and
        `served_model_aliases`).
    :param chat_template_content_format: how message content reaches the template (core.content_format):
        "auto" (detected from the template), "string" or "openai".
    :param structured_output_engine: a registered structured-output engine; None: the one of highest
        priority (xgrammar, from the pytorch backend plugin).
    :param adapters: the LoRA adapters served (core.adapters.AdapterPolicy: start-up modules, slots,
        maximum rank, runtime loading and its allowed paths).
    :param tensor_parallel_size: ranks that each hold 1/N of the model (``--tensor-parallel-size``);
        1 serves in this process alone. A backend that cannot shard the model refuses it at start-up.
    :param speculative: speculative decoding (core.speculative.SpeculativeConfig: the proposer, tokens
        per step, n-gram lengths); None: off. A backend that cannot speculate refuses it at start-up.
    """

    model: str | None = None
    backend: str | None = None
    dtype: str = "auto"
    quantization: str = "auto"
    device: str | None = None
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_gib: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    chat_template: str | None = None
    served_model_name: str | None = None
    served_model_aliases: tuple[str, ...] = ()
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    media: MediaPolicy = field(default_factory=MediaPolicy)
    allow_special_tokens_in_content: bool = False
    chat_template_content_format: str = AUTO
    structured_output_engine: str | None = None
    adapters: AdapterPolicy = field(default_factory=AdapterPolicy)
    speculative: SpeculativeConfig | None = None
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        self._normalise_names()
        check_content_format(self.chat_template_content_format)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise _fail("dtype", self.dtype, "one of auto, float32, bfloat16, float16")
        if self.quantization not in QUANTIZATIONS:
            raise _fail("quantization", self.quantization, "one of " + ", ".join(QUANTIZATIONS))
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        _check_int("block_size", self.block_size, 1, 1024)
        if self.kv_cache_memory_gib is not None:
            _check_float("kv_cache_memory_gib", self.kv_cache_memory_gib, 0.0, 1e6, low_open=True)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 1024)
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if not isinstance(self.backend_options, Mapping) or not all(isinstance(k, str) for k in self.backend_options):
            raise _fail("backend_options", self.backend_options, "a mapping of option names to values")
        _check_bool("allow_special_tokens_in_content", self.allow_special_tokens_in_content)
        if not isinstance(self.media, MediaPolicy):
            raise _fail("media", self.media, "a core.media.MediaPolicy")
        if not isinstance(self.adapters, AdapterPolicy):
            raise _fail("adapters", self.adapters, "a core.adapters.AdapterPolicy")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise _fail("speculative", self.speculative, "a core.speculative.SpeculativeConfig")

    def _normalise_names(self) -> None:
        names, aliases = self.served_model_name, self.served_model_aliases
        if isinstance(names, (list, tuple)):
            if not names:
                raise _fail("served_model_name", names, "a name or a non-empty list of names")
            names, aliases = names[0], (*names[1:], *aliases)
        if isinstance(aliases, str) or not isinstance(aliases, (list, tuple)):
            raise _fail("served_model_aliases", aliases, "a list of names")
        for name in (names, *aliases):
            if name is not None and (not isinstance(name, str) or not name):
                raise _fail("served_model_name", name, "a non-empty string")
        object.__setattr__(self, "served_model_name", names)
        object.__setattr__(self, "served_model_aliases", tuple(dict.fromkeys(a for a in aliases if a != names)))

    @property
    def model_name(self) -> str:
        """The name clients use for this model."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return "default"
        return self.model.rstrip("/").rsplit("/", 1)[-1]
