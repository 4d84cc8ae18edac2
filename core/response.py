"""Whole responses assembled from a request's stream (for offline inference and non-streaming APIs)."""

from __future__ import annotations

from collections.abc import AsyncIterable
from dataclasses import dataclass, field

from core.backend import TokenLogprob
from core.request import RequestOutput


@dataclass
class Completion:
    """One finished choice."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Response:
    """A finished request: its choices, token counts, and the index of its prompt in a batch.

    `error` is the message of a request that failed (its unfinished choices end with finish_reason
    "error"); `Pipeline.infer` answers a batch item that way instead of failing the batch.
    `prompt_logprobs`: one entry per prompt token (the first None) when the config asked for them.
    """

    session_id: str = ""
    index: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    choices: list[Completion] = field(default_factory=list)
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids if self.choices else []

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason if self.choices else None

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    def add(self, output: RequestOutput) -> None:
        """Fold one streamed output into this response."""
        while len(self.choices) <= output.index:
            self.choices.append(Completion(index=len(self.choices)))
        choice = self.choices[output.index]
        self.session_id = output.session_id
        self.prompt_tokens = output.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, output.cached_tokens)
        choice.text += output.text
        choice.token_ids.extend(output.token_ids)
        if output.logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + list(output.logprobs)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = list(output.prompt_logprobs)
        if output.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = output.finish_reason, output.stop_reason


    def fail(self, message: str, n: int = 1) -> None:
        """Record a failure: `message`, and finish_reason "error" on every one of the n choices still open."""
        self.error = message
        while len(self.choices) < n:
            self.choices.append(Completion(index=len(self.choices)))
        for choice in self.choices:
            if choice.finish_reason is None:
                choice.finish_reason = "error"


async def collect(stream: AsyncIterable[RequestOutput], index: int = 0) -> Response:
    """Consume a request's stream into a Response."""
    response = Response(index=index)
    async for output in stream:
        response.add(output)
    return response
