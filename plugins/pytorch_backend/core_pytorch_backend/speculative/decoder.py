"""The engine loop's speculative decoding: which rows propose this step, the sampler rows that verify a
proposal, and what a verified row keeps.

A decoding row with drafts ``d_1..d_k`` runs ``1 + k`` query tokens (its last token and the drafts) in the
step's one forward pass, beside plain decode and prefill rows; the runner returns logits for each of
those positions. Position j is sampled as an ordinary row whose output so far ends with ``d_1..d_j``
(penalties, min_tokens bans and logprobs see exactly what they would without speculation), and the row
keeps the drafts up to the first one the sampled token differs from, plus that sampled token
(core.scheduling.speculation: exact for greedy rows; rejection sampling for sampled rows). Then the
kept tokens are cut at the first that ends the choice (a stop id, max_tokens, the context window).

The runner gives each verified position an attention row of its own (one query over the context up to
it, `model_runner._attention_rows`), so it runs the decode kernel exactly as a one-token step would; a
chunked-prefill row would round differently and flip near ties of greedy decoding.

Rows that never speculate: a request that opts out (``GenerationConfig.speculative`` False), structured
output (its matcher would have to be advanced through each draft and rolled back), embeddings, a
sequence with images (their per-sequence attention spans), and an n > 1 request before its choices fork
(they are prefilling then anyway).

Seeds: position j of a verified row draws from the row's own generator, after positions 0..j-1, so a
seeded request is reproducible for the same batch composition; across compositions its tokens may
differ (the token budget left by other rows can shorten its drafts, and each verified position consumes
a draw), though they always follow the same distribution.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from core.scheduling import ScheduledSequence
from core.scheduling import Sequence as Seq
from core.scheduling.speculation import AcceptanceBackoff, accepted_length, draft_token_cost, verified_tokens
from core.speculative import DraftRequest, Proposer, SpecDecodeStats, SpeculativeConfig
from core_pytorch_backend.request_state import RequestState
from core_pytorch_backend.sampling_batch import SamplingRow


class SpeculativeDecoder:
    """A proposer, each row's back-off gate, and the counters of `/metrics`."""

    def __init__(self, proposer: Proposer, config: SpeculativeConfig, vocab_size: int | None = None) -> None:
        self.proposer = proposer
        self.config = config
        self.vocab_size = vocab_size  # a proposal is cut at its first token outside the target's vocabulary
        self.stats = SpecDecodeStats()
        self._backoff: dict[str, AcceptanceBackoff] = {}

    # -- proposing ------------------------------------------------------------------------------------

    def drafts(self, rows: Iterable[tuple[RequestState, Seq]], max_model_len: int) -> dict[str, list[int]]:
        """Proposals for the decoding rows that may speculate this step, by sequence id."""
        decoding = [(state, seq) for state, seq in rows if _decodes(seq)]
        cost = draft_token_cost(len(decoding))  # of a verified token, in a step of this many decoding rows
        wanted = []
        for state, seq in decoding:
            request = self._draft_request(state, seq, max_model_len, cost)
            if request is not None:
                wanted.append(request)
        if not wanted:
            return {}
        proposals = self.proposer.propose(wanted)
        kept = {r.seq_id: self._valid(p[: r.max_tokens]) for r, p in zip(wanted, proposals, strict=True)}
        return {seq_id: tokens for seq_id, tokens in kept.items() if tokens}

    def _valid(self, tokens: Sequence[int]) -> list[int]:
        """`tokens` up to the first that is not a token id of the target (a proposer's bug costs nothing)."""
        limit = self.vocab_size or 2**62
        for j, token in enumerate(tokens):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < limit:
                return list(tokens[:j])
        return list(tokens)

    def _draft_request(self, state: RequestState, seq: Seq, max_model_len: int,
                       cost: float) -> DraftRequest | None:
        if not speculates(state) or seq.multimodal is not None:
            return None
        left = min(state.request.max_new_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens)
        k = min(self.config.num_speculative_tokens, left - 1)  # the row also emits one token of its own
        if k > 0 and self.config.backoff:
            k = self._gate(seq.seq_id).draft_length(k, cost)
        if k <= 0:
            return None
        return DraftRequest(seq.seq_id, seq.token_ids, seq.num_prompt_tokens, k)

    def _gate(self, seq_id: str) -> AcceptanceBackoff:
        gate = self._backoff.get(seq_id)
        if gate is None:
            gate = self._backoff[seq_id] = AcceptanceBackoff()
        return gate

    # -- verifying ------------------------------------------------------------------------------------

    def rows(self, state: RequestState, choice: int, chunk: ScheduledSequence,
             device: torch.device) -> list[SamplingRow]:
        """One sampler row per verified position of `chunk` (its last token, then each draft)."""
        seq, drafts = chunk.seq, chunk.draft_token_ids
        output = seq.output_token_ids
        generator = state.generator(choice, device)
        return [SamplingRow(state.params, seq.prompt_token_ids, [*output, *drafts[:j]], generator,
                            state.banned_at(len(output) + j), None) for j in range(len(drafts) + 1)]

    def verify(self, state: RequestState, chunk: ScheduledSequence, sampled: Sequence[int]) -> list[int]:
        """The tokens the row keeps: accepted drafts and the next token, cut at the first that ends it."""
        drafts = chunk.draft_token_ids
        accepted = accepted_length(drafts, sampled)
        self.stats.record(len(drafts), accepted)
        if self.config.backoff:
            self._gate(chunk.seq.seq_id).record(len(drafts), accepted)
        tokens = verified_tokens(drafts, sampled)
        seq = chunk.seq
        for j, token in enumerate(tokens, start=1):
            if state.finish_reason_at(seq.num_output_tokens + j, seq.num_tokens + j, token) is not None:
                return tokens[:j]
        return tokens

    def release(self, seq_id: str) -> None:
        """The sequence ended: forget its gate and whatever the proposer keeps for it."""
        self._backoff.pop(seq_id, None)
        self.proposer.release(seq_id)

    def snapshot(self) -> SpecDecodeStats:
        return self.stats.snapshot()


def _decodes(seq: Seq) -> bool:
    """The sequence's next chunk is one token (it has sampled everything it has)."""
    return seq.num_computed_tokens == seq.num_tokens - 1


def speculates(state: RequestState) -> bool:
    """Whether the request's rows may speculate at all (see the module docstring)."""
    request = state.request
    return (request.config.speculative and request.constraint is None and state.pooling is None
            and (state.n == 1 or state.forked))


def make_speculative_decoder(config: SpeculativeConfig, vocab_size: int | None = None,
                             plugins: Any = None) -> SpeculativeDecoder:
    """The decoder over the proposer registered as ``config.method`` (core.resolve)."""
    from core.plugins import get_plugins
    from core.resolve import speculative_proposer

    entry = speculative_proposer(plugins or get_plugins(), config.method)
    return SpeculativeDecoder(entry.load()(config), config, vocab_size)
