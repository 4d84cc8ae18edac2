"""Pure translations between OpenAI's wire format and the engine: requests in, responses out.

Nothing here touches the network or the engine, so each rule is unit-tested on its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from core.backend import TokenLogprob
from core.chat_template import validate_tools
from core.config import GenerationConfig
from core.errors import InvalidRequestError, UnsupportedError
from core.parsers import ToolCall, ToolCallFormat
from core.server import structured_fields as sf
from core.server.openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, check_name
from core.server.postprocess import ChatMessageParts, StreamPiece
from core.structured_output import StructuredOutput

Decode = Callable[[Sequence[int]], str]

# Request fields copied to GenerationConfig under another name (or the same one) when sent.
_RENAMED = {"min_tokens": "min_new_tokens"}
_COPIED = ("n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
           "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens",
           "include_stop_str_in_output", "speculative", "allowed_token_ids", "truncate_prompt_tokens")
VLLM_STRUCTURED_FIELDS = ("structured_outputs", *sf.GUIDED_FIELDS)


def check_stream_options(req: SamplingFields) -> None:
    """stream_options only makes sense for a streamed response; prompt_logprobs only for a whole one
    (as in vLLM)."""
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise UnsupportedError("prompt_logprobs is not available when stream is true", param="prompt_logprobs")


def logit_bias_by_id(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if bias is None:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias") from None


def _sent_fields(req: SamplingFields) -> dict[str, Any]:
    """Generation fields the client sent (None means not sent, so model defaults apply)."""
    if req.bad_words:
        raise UnsupportedError("bad_words is not supported; ban single tokens with logit_bias (-100)",
                               param="bad_words")
    if req.use_beam_search:
        raise UnsupportedError("beam search is not supported (use n and logprobs)", param="use_beam_search")
    fields: dict[str, Any] = {name: getattr(req, name) for name in _COPIED if getattr(req, name) is not None}
    fields.update({new: getattr(req, old) for old, new in _RENAMED.items() if getattr(req, old) is not None})
    if req.stop is not None:
        fields["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    if req.logit_bias is not None:
        fields["logit_bias"] = logit_bias_by_id(req.logit_bias)
    constraint = sf.vllm_constraint({name: getattr(req, name) for name in VLLM_STRUCTURED_FIELDS})
    if constraint is not None:
        fields["structured_output"] = constraint
    return fields


def chat_max_tokens_field(req: ChatCompletionRequest) -> str:
    """The field that sets the token limit: max_completion_tokens wins over the deprecated max_tokens."""
    return "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"


def chat_param_names(req: ChatCompletionRequest) -> dict[str, str]:
    """Engine field -> the chat request's own field name, for error messages."""
    return {"max_new_tokens": chat_max_tokens_field(req), "min_new_tokens": "min_tokens"}


COMPLETION_DEFAULT_MAX_TOKENS = 16
COMPLETION_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs": "logprobs"}


def chat_generation_config(req: ChatCompletionRequest, forced_call: StructuredOutput | None = None) -> GenerationConfig:
    """GenerationConfig for a chat request; raises InvalidRequestError naming the engine field.
    `forced_call` is the constraint of a forced tool call (`forced_tool_call`)."""
    check_stream_options(req)
    fields = _sent_fields(req)
    constraint = sf.one_constraint(forced_call, sf.response_format_constraint(req.response_format),
                                   fields.get("structured_output"))
    if constraint is not None:
        fields["structured_output"] = constraint
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if limit is not None:
        fields["max_new_tokens"] = limit
    if req.logprobs is not None:
        fields["logprobs"] = req.logprobs
    if req.top_logprobs is not None:
        fields["top_logprobs"] = req.top_logprobs
    if req.prompt_logprobs is not None:
        fields["prompt_logprobs"] = req.prompt_logprobs
    return GenerationConfig(**fields)


def completion_generation_config(req: CompletionRequest) -> GenerationConfig:
    """GenerationConfig for a text-completion request (logprobs is the number of alternatives)."""
    check_stream_options(req)
    if req.max_tokens is not None and req.max_tokens < (0 if req.echo else 1):
        raise InvalidRequestError("max_tokens must be at least 1 (0 is allowed with echo)", param="max_tokens")
    if req.suffix:
        raise UnsupportedError("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise UnsupportedError("best_of is not supported (use n)", param="best_of")
    fields = _sent_fields(req)
    # Unsent, the legacy API's 16 (OpenAI's and vLLM's default), not the rest of the context window; echo
    # alone (0): one token is generated and dropped, as vLLM does.
    limit = req.max_tokens if req.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
    fields["max_new_tokens"] = max(limit, 1)
    if req.logprobs is not None:
        fields["logprobs"], fields["top_logprobs"] = True, req.logprobs
    wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    if wanted:
        fields["prompt_logprobs"] = max(wanted)
    return GenerationConfig(**fields)


@dataclass(frozen=True)
class Echo:
    """What a completion choice repeats of its prompt. With echo, the prompt text comes before the
    generated text and, with logprobs, the prompt tokens' logprobs before the generated ones (the first
    token's null); `prompt_only` (echo with max_tokens 0) drops what was generated. Echo() repeats nothing."""

    text: str = ""
    prompt_token_ids: Sequence[int] = ()
    logprobs: int | None = None
    prompt_only: bool = False

    def choice_text(self, generated: str, first: bool = True) -> str:
        """The text of a choice (or of its first streamed chunk when `first`)."""
        return (self.text if first else "") + ("" if self.prompt_only else generated)

    def choice_logprobs(self, prompt: Sequence[TokenLogprob | None] | None, generated: Sequence[TokenLogprob] | None,
                        decode: Decode, offset: int = 0, first: bool = True) -> dict[str, Any] | None:
        """Legacy logprobs of a choice (or chunk): the echoed prompt's when `first`, then the generated
        tokens' from text offset `offset` (past the echoed text)."""
        start = offset + (len(self.text) if first else 0)
        kept = None if self.prompt_only else completion_logprobs(generated, decode, start)
        if not first or self.logprobs is None or prompt is None:
            return kept
        echoed = prompt_legacy_logprobs(self.prompt_token_ids, prompt, self.logprobs, decode)
        return echoed if kept is None else {key: echoed[key] + kept[key] for key in echoed}


def completion_echo(req: CompletionRequest, prompt: str | list[int], token_ids: Sequence[int],
                    decode: Decode) -> Echo:
    """The Echo of one prompt of a completion request (a token prompt echoes its decoded text)."""
    if not req.echo:
        return Echo()
    text = prompt if isinstance(prompt, str) else decode(prompt)
    return Echo(text, tuple(token_ids), req.logprobs, req.max_tokens == 0)


def check_text_output(req: ChatCompletionRequest) -> None:
    """The response is text: a request for audio output (`modalities` with "audio", `audio`) is a 400 naming
    the field, where ignoring it would leave the client without the message.audio it asked for."""
    if req.modalities is not None and set(req.modalities) != {"text"}:
        raise UnsupportedError(f'modalities must be ["text"]: this server gives no audio, got {req.modalities!r}',
                               param="modalities")
    if req.audio is not None:
        raise UnsupportedError("audio output is not supported", param="audio")


def check_template_fields(req: ChatCompletionRequest) -> None:
    """vLLM's template fields: ``continue_final_message`` (continue the final assistant message, which core
    does whenever add_generation_prompt is false) and ``chat_template``, which a request may not set."""
    if req.chat_template is not None:
        raise UnsupportedError("a request cannot set its own chat_template; start the server with --chat-template",
                               param="chat_template")
    if req.continue_final_message and req.add_generation_prompt:
        raise InvalidRequestError("continue_final_message continues the final assistant message, so it needs "
                                  "add_generation_prompt: false", param="continue_final_message")
    if req.continue_final_message and req.messages[-1].get("role") != "assistant":
        raise InvalidRequestError("continue_final_message needs the final message to be the assistant's",
                                  param="continue_final_message")


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's values (chat and Responses)


def reasoning_switch(effort: Any, param: str) -> dict[str, Any] | None:
    """A reasoning effort as the templates' enable_thinking switch: "none" turns thinking off, any other effort
    on; an effort the API does not define is a 400 naming `param`."""
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise InvalidRequestError(f"{param} must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}", param=param)
    return {"enable_thinking": effort != "none"}


def chat_template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The template switches of a chat request: its reasoning_effort's, under its own chat_template_kwargs
    (which win)."""
    switch = reasoning_switch(req.reasoning_effort, "reasoning_effort")
    return {**switch, **(req.chat_template_kwargs or {})} if switch else req.chat_template_kwargs


def check_tool_choice(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools to render into the prompt, checked (their names as OpenAI allows them, whatever tool_choice
    says); "none" hides them."""
    if req.tool_choice not in (None, "auto", "none", "required") and not isinstance(req.tool_choice, dict):
        raise InvalidRequestError('tool_choice must be "auto", "none", "required" or {"type": "function", '
                                  f'"function": {{"name": ...}}}}, got {req.tool_choice!r}', param="tool_choice")
    tools = validate_tools(req.tools)
    for i, tool in enumerate(tools or ()):
        check_name(tool["function"]["name"], f"tools[{i}].function.name")
    return None if req.tool_choice == "none" else tools


def forced_tool_call(req: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
                     call_format: ToolCallFormat | None) -> StructuredOutput | None:
    """The constraint of `tool_choice: "required"` or a named function (None for auto / none)."""
    choice = req.tool_choice
    if choice == "required":
        return sf.tool_call_constraint(tools, None, call_format)
    if not isinstance(choice, dict):
        return None
    function = choice.get("function") if choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError('tool_choice must be {"type": "function", "function": {"name": ...}}',
                                  param="tool_choice")
    return sf.tool_call_constraint(tools, name, call_format)


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]],
                       param: str = "prompt") -> list[str | list[int]]:
    """The independent prompts of a completion request (or the inputs of an embedding request, which
    come in the same shapes; `param` names the field): a string or token list is one."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError(f"{param} must not be empty", param=param)
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


# -- responses -------------------------------------------------------------------------------------


def finish_reason(reason: str | None, *, tool_calls: bool = False) -> str | None:
    """The engine's finish reason as OpenAI's: "stop" is "tool_calls" when the choice called tools that
    `reports_tool_calls`; "abort" stays "abort" (as in vLLM)."""
    if reason == "stop" and tool_calls:
        return "tool_calls"
    return reason


def reports_tool_calls(req: ChatCompletionRequest) -> bool:
    """Whether a choice that called tools finishes "tool_calls": not under a named tool_choice, whose call
    OpenAI (and vLLM) end "stop"; under auto and required it does."""
    return not isinstance(req.tool_choice, dict)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _token_entry(token_id: int, logprob: float, decode: Decode) -> dict[str, Any]:
    text = decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob] | None, decode: Decode) -> dict[str, Any] | None:
    """Chat's `logprobs: {"content": [...]}` with top_logprobs alternatives per token."""
    if entries is None:
        return None
    return {"content": [
        {**_token_entry(e.token_id, e.logprob, decode),
         "top_logprobs": [_token_entry(t, lp, decode) for t, lp in e.top]}
        for e in entries
    ]}


def completion_logprobs(entries: Sequence[TokenLogprob] | None, decode: Decode,
                        offset: int = 0) -> dict[str, Any] | None:
    """Text completion's legacy logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    if entries is None:
        return None
    tokens = [decode([e.token_id]) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{decode([t]): lp for t, lp in e.top} for e in entries], "text_offset": offsets}


def prompt_legacy_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], k: int,
                           decode: Decode) -> dict[str, Any]:
    """The prompt's tokens in the legacy logprobs format: the first token's logprob and alternatives
    are null (nothing precedes it), each other's `k` alternatives from its entry."""
    tokens = [decode([t]) for t in token_ids]
    offsets = [0, *itertools.accumulate(len(t) for t in tokens)][: len(tokens)]
    return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else {decode([t]): lp for t, lp in e.top[:k]} for e in entries],
            "text_offset": offsets}


def vllm_prompt_logprobs(entries: Sequence[TokenLogprob | None] | None, decode: Decode) -> list[Any] | None:
    """vLLM's `prompt_logprobs`: per prompt token null (the first) or {token id: {logprob, rank,
    decoded_token}} for the token itself and its alternatives."""
    if entries is None:
        return None
    return [None if e is None else _vllm_entry(e, decode) for e in entries]


def _vllm_entry(entry: TokenLogprob, decode: Decode) -> dict[str, Any]:
    out = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": decode([entry.token_id])}}
    for rank, (token, logprob) in enumerate(entry.top, start=1):
        out.setdefault(str(token), {"logprob": logprob, "rank": rank, "decoded_token": decode([token])})
    return out


def _chunk(kind: str, response_id: str, created: int, model: str, choices: list[dict[str, Any]],
           usage_: dict[str, Any] | None) -> dict[str, Any]:
    chunk = {"id": response_id, "object": kind, "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def tool_call_object(call: ToolCall) -> dict[str, Any]:
    """One entry of `message.tool_calls`."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_message(parts: ChatMessageParts) -> dict[str, Any]:
    """The assistant message of a whole response: content, reasoning_content and tool_calls when present."""
    message: dict[str, Any] = {"role": "assistant", "content": parts.content}
    if parts.reasoning_content is not None:
        message["reasoning_content"] = parts.reasoning_content
    if parts.tool_calls:
        message["tool_calls"] = [tool_call_object(call) for call in parts.tool_calls]
    return message


def _piece_delta(piece: StreamPiece) -> dict[str, Any]:
    if piece.kind == "tool_call":
        call = {"index": piece.index, "id": piece.id, "type": "function",
                "function": {"name": piece.name, "arguments": ""}}
        return {"tool_calls": [call]}
    if piece.kind == "arguments":
        return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]}
    return {"reasoning_content" if piece.kind == "reasoning" else "content": piece.text}


def chat_deltas(pieces: Sequence[StreamPiece]) -> list[dict[str, Any]]:
    """The `delta` objects of streamed pieces, one chunk each, in order: a tool call's name comes in its
    own chunk (with its id and type), then its arguments; adjacent text of one kind shares a chunk."""
    deltas: list[dict[str, Any]] = []
    for piece in pieces:
        delta = _piece_delta(piece)
        key = next(iter(delta))
        if deltas and key in ("content", "reasoning_content") and list(deltas[-1]) == [key]:
            deltas[-1][key] += delta[key]
        else:
            deltas.append(delta)
    return deltas


def chat_chunk(response_id: str, created: int, model: str, choices: list[dict[str, Any]],
               usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    """One `chat.completion.chunk`."""
    return _chunk("chat.completion.chunk", response_id, created, model, choices, usage_)


def chat_delta_choice(index: int, delta: dict[str, Any], finish: str | None = None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a chat chunk."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def completion_chunk(response_id: str, created: int, model: str, choices: list[dict[str, Any]],
                     usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed `text_completion` object."""
    return _chunk("text_completion", response_id, created, model, choices, usage_)


def completion_choice(index: int, text: str, finish: str | None = None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a text completion (whole or streamed)."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
