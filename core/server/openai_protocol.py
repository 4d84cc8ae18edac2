"""OpenAI request bodies (with vLLM's extra sampling fields), validated strictly.

Every optional field defaults to None, meaning "the client did not send it": the translation layer
passes only sent fields on, so the model's generation_config supplies the rest. Types are strict (a
string where a number belongs is a 400 naming the field); ranges are checked once, by GenerationConfig,
but where OpenAI's is narrower (`Temperature`: 0 to 2, where GenerationConfig takes up to 10,000 as vLLM does).
Unknown fields are accepted and ignored, as OpenAI-compatible servers do. Names the API restricts (a
function's, a json_schema format's) are checked by `check_name`, wherever the routes read them.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from core.errors import InvalidRequestError

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
Temperature = Annotated[float | None, Field(ge=0.0, le=2.0)]  # OpenAI's range (Anthropic's is 0 to 1)


def check_name(name: Any, param: str) -> None:
    """A function's or a json_schema response format's name as OpenAI accepts it (1 to 64 letters, digits,
    underscores and dashes); anything else is a 400 naming `param`."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequestError(f"{param} must be 1 to 64 letters, digits, underscores or dashes, got {name!r}",
                                  param=param)


class StreamOptions(BaseModel):
    """`stream_options`: only valid together with `stream: true`. vLLM's `continuous_usage_stats` (with
    include_usage) puts the usage so far on every chunk."""

    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False

    @property
    def continuous(self) -> bool:
        """Whether every chunk carries the running usage."""
        return self.include_usage and self.continuous_usage_stats


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    n: int | None = None
    temperature: Temperature = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    request_id: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None  # refused (a 400) rather than ignored
    use_beam_search: bool | None = None  # true is refused
    speculative: bool | None = None  # false: this request does not speculate (core.speculative)
    # vLLM's structured output (core.server.structured_fields)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # checked by core.chat_template.validate_tools (names tools[i]...)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # the templates' enable_thinking switch ("none": off)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: with add_generation_prompt false, as core does anyway
    chat_template: str | None = None  # vLLM's per-request template: refused (a 400), never silently ignored
    modalities: list[str] | None = None  # "text" alone: audio output is refused (a 400)
    audio: dict[str, Any] | None = None  # audio output's voice and format: refused


class CompletionRequest(SamplingFields):
    """POST /v1/completions: a prompt string, token ids, or a list of either (one request each)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages rendered with the template."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[Any] | None = None  # checked by core.chat_template.validate_tools (names tools[i]...)
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape)."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    tokens: list[int]


class AbortRequest(BaseModel):
    """POST /abort: one request by id, or every request."""

    model_config = ConfigDict(strict=True, extra="forbid")
    request_id: str | None = None
    all: bool = False
