"""A deterministic in-memory backend and a byte-level tokenizer, for tests of the core.

FakeBackend follows the Backend contract closely enough to be run by the contract suite: it simulates
paged KV blocks, honours stop tokens, max/min new tokens and n, aborts promptly, sleeps and wakes, and
counts every call so tests can check that the engine ends each session exactly once. Each next token is
a pure function of the full context, so outputs are reproducible and independent of batching.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from core.backend import (
    WAKE_TAGS,
    Backend,
    BackendOutput,
    BackendStats,
    EndResult,
    FinishReason,
    GenerateRequest,
    ModelInfo,
    TokenLogprob,
)
from core.errors import BackendError

BOS, EOS = 256, 257


class ByteTokenizer:
    """Token ids 0-255 are UTF-8 bytes; 256 is <bos>, 257 is <eos>."""

    eos_token_id = EOS
    bos_token_id = BOS
    eos_token = "<eos>"
    bos_token = "<bos>"
    all_special_ids = [BOS, EOS]
    vocab_size = 258

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        for piece in text.split(self.eos_token):
            ids.extend(piece.encode("utf-8"))
            ids.append(EOS)
        ids.pop()
        return ([BOS] if add_special_tokens else []) + ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        out, buffer = [], bytearray()
        for t in token_ids:
            if t < 256:
                buffer.append(t)
                continue
            out.append(buffer.decode("utf-8", errors="replace"))
            buffer.clear()
            if not skip_special_tokens:
                out.append(self.bos_token if t == BOS else self.eos_token)
        out.append(buffer.decode("utf-8", errors="replace"))
        return "".join(out)


def next_token_rule(context: Sequence[int], choice: int) -> int:
    """A printable ASCII byte that depends on the whole context (so truncating it changes outputs)."""
    h = (len(context) * 1_000_003 + choice * 7919) % 2**31
    for t in context:
        h = (h * 31 + t) % 2**31
    return 97 + h % 26  # 'a'..'z'


def fake_prompt_logprobs(request: GenerateRequest, out: BackendOutput) -> BackendOutput:
    """`out` with the fake's prompt logprobs when the request asks for them (see FakeBackend)."""
    k = request.config.prompt_logprobs
    if k is None:
        return out
    entries = [None] + [TokenLogprob(t, -1.0, tuple((t + j, -1.0 - j) for j in range(k)), rank=1)
                        for t in request.prompt_token_ids[1:]]
    return dataclasses.replace(out, prompt_logprobs=entries)


@dataclass
class _Running:
    request: GenerateRequest
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    blocks: int = 0


class FakeBackend(Backend):
    """See the module docstring. `script` (token ids) replaces the rule for every choice; `script_for`
    picks a script per request from its prompt ids (None keeps the rule), e.g. to emit a fixed tool call.
    `model_info` replaces the fake's own (a test may pose as another architecture or ship a template).
    Prompt logprobs are made up: prompt token t scores -1.0, rank 1, its alternatives t + j score -1 - j."""

    supports_prompt_logprobs = True

    def __init__(self, *, max_model_len: int = 512, num_blocks: int = 256, block_size: int = 4,
                 step_delay: float = 0.0, script: Sequence[int] | None = None,
                 fail_after: int | None = None, next_token: Callable[[Sequence[int], int], int] = next_token_rule,
                 script_for: Callable[[Sequence[int]], Sequence[int] | None] | None = None,
                 model_info: ModelInfo | None = None):
        self.tokenizer = ByteTokenizer()
        self.model_info = ModelInfo(name="fake", architecture="FakeForCausalLM", max_model_len=max_model_len,
                                    eos_token_ids=(EOS,), vocab_size=ByteTokenizer.vocab_size)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.step_delay, self.script, self.fail_after, self.next_token = step_delay, script, fail_after, next_token
        self.script_for = script_for
        if model_info is not None:
            self.model_info = model_info
        self.calls: Counter[tuple[str, str]] = Counter()
        self._running: dict[str, _Running] = {}
        self._known: set[str] = set()
        self._asleep: set[str] = set()
        self._used_blocks = 0
        self.closed = False

    # -- generate ---------------------------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> AsyncIterator[BackendOutput]:
        self.calls["generate", request.session_id] += 1
        return self._generate(request)

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[BackendOutput]:
        sid = request.session_id
        self._known.add(sid)
        run = self._running[sid] = _Running(request)
        try:
            script = self.script_for(request.prompt_token_ids) if self.script_for else self.script
            contexts = [list(request.prompt_token_ids) for _ in range(request.config.n)]
            self._grow(run, len(contexts[0]) * request.config.n)
            open_choices = set(range(request.config.n))
            step = 0
            while open_choices:
                await asyncio.sleep(self.step_delay)
                if run.aborted.is_set():
                    for i in sorted(open_choices):
                        yield BackendOutput([], index=i, finish_reason=FinishReason.ABORT)
                    return
                if "kv_cache" in self._asleep:
                    raise BackendError("the KV cache was released (the backend is asleep)")
                if self.fail_after is not None and step >= self.fail_after:
                    raise RuntimeError("injected backend failure")
                for i in sorted(open_choices):
                    out = self._step(run, contexts[i], i, step, script)
                    if out.finish_reason is not None:
                        open_choices.discard(i)
                    yield fake_prompt_logprobs(request, out) if step == 0 and i == 0 else out
                step += 1
        finally:
            self._release(run)

    def _step(self, run: _Running, context: list[int], index: int, step: int,
              script: Sequence[int] | None) -> BackendOutput:
        request, cfg = run.request, run.request.config
        if script is not None:
            token = script[step] if step < len(script) else EOS
        else:
            token = self.next_token(context, index)
        if step < cfg.min_new_tokens and token in request.stop_token_ids:
            token = 120  # 'x': never stop before min_new_tokens
        if cfg.allowed_token_ids and token not in cfg.allowed_token_ids:
            token = cfg.allowed_token_ids[token % len(cfg.allowed_token_ids)]  # as a sampler masks the rest
        context.append(token)
        self._grow(run, 1)
        generated = len(context) - len(request.prompt_token_ids)
        finish, stop_id = None, None
        if token in request.stop_token_ids and generated > cfg.min_new_tokens - 1:
            finish, stop_id = FinishReason.STOP, token
        elif generated >= request.max_new_tokens:
            finish = FinishReason.LENGTH
        logprobs = [TokenLogprob(token, -0.5, tuple((token + k, -0.5 - k) for k in range(cfg.top_logprobs)))] \
            if cfg.logprobs else None
        return BackendOutput([token], index=index, finish_reason=finish, logprobs=logprobs, stop_token_id=stop_id)

    def _grow(self, run: _Running, tokens: int) -> None:
        # Fake paging: one block per block_size tokens, counted per request.
        run_tokens = run.blocks * self.block_size + tokens
        needed = -(-run_tokens // self.block_size)
        self._used_blocks += needed - run.blocks
        run.blocks = needed

    def _release(self, run: _Running) -> None:
        if self._running.get(run.request.session_id) is run:
            del self._running[run.request.session_id]
            self._used_blocks -= run.blocks
            run.blocks = 0

    # -- control ----------------------------------------------------------------------------------

    async def abort(self, session_id: str) -> None:
        self._abort(session_id)

    async def abort_many(self, session_ids: Sequence[str]) -> None:
        self.calls["abort_many", ""] += 1
        for session_id in session_ids:
            self._abort(session_id)

    def _abort(self, session_id: str) -> None:
        self.calls["abort", session_id] += 1
        run = self._running.get(session_id)
        if run is not None:
            run.aborted.set()
            self._release(run)  # blocks are freed at once, not when the stream notices

    async def end(self, session_id: str) -> EndResult:
        self.calls["end", session_id] += 1
        run = self._running.get(session_id)
        if run is not None:
            run.aborted.set()
            self._release(run)
        if session_id in self._known:
            self._known.discard(session_id)
            return EndResult.ENDED
        return EndResult.NOT_FOUND

    async def sleep(self, level: int) -> None:
        self._asleep = set(WAKE_TAGS)

    async def wakeup(self, tags: Sequence[str]) -> None:
        self._asleep -= set(tags)

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def stats(self) -> BackendStats:
        return BackendStats(running=len(self._running), sessions=len(self._known), kv_blocks_total=self.num_blocks,
                            kv_blocks_used=self._used_blocks, block_size=self.block_size,
                            is_sleeping=self.is_sleeping)

    async def close(self) -> None:
        for run in list(self._running.values()):
            run.aborted.set()
            self._release(run)
        self.closed = True

    def count(self, call: str, session_id: str) -> int:
        """How many times `call` ("generate", "abort", "end") was made for a session; ("abort_many", "")
        counts batched aborts."""
        return self.calls[call, session_id]
