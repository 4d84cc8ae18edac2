"""Prompt-lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, searched in its prompt and output so far (no model, no state).

Longer suffixes are tried first (``ngram_max`` down to ``ngram_min``): a longer match is a better
predictor. The search is ``bytes.rfind`` over the token ids packed as 4-byte integers, so a step costs
a C-speed scan of the context rather than a Python loop.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from core.speculative import DraftRequest, Proposer, SpeculativeConfig

_WIDTH = array("i").itemsize


def lookup(token_ids: Sequence[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """`k` tokens predicted to follow the latest earlier occurrence of the longest suffix of `token_ids`
    (between `ngram_min` and `ngram_max` tokens) that occurs before; [] when none does."""
    if k <= 0 or len(token_ids) < ngram_min + 1:
        return []
    packed = array("i", token_ids).tobytes()
    total = len(token_ids)
    for n in range(min(ngram_max, total - 1), ngram_min - 1, -1):
        start = _latest_earlier(packed, total, n)
        if start is not None:
            return _continuation(token_ids, start + n, k)
    return []


def _continuation(token_ids: Sequence[int], first: int, k: int) -> list[int]:
    """`k` tokens predicted to follow `token_ids`, as the ones from `first` on followed the match; past
    the end the prediction continues itself (a match close to the end predicts a repeating loop)."""
    total = len(token_ids)
    out: list[int] = []
    for index in range(first, first + k):
        out.append(token_ids[index] if index < total else out[index - total])
    return out


def _latest_earlier(packed: bytes, total: int, n: int) -> int | None:
    """Token index of the latest occurrence of the last `n` tokens that starts before them."""
    suffix = packed[(total - n) * _WIDTH :]
    last_start = (total - n - 1) * _WIDTH  # the latest byte offset a match may start at
    while last_start >= 0:
        at = packed.rfind(suffix, 0, last_start + len(suffix))
        if at < 0:
            return None
        if at % _WIDTH == 0:
            return at // _WIDTH
        last_start = at - 1  # misaligned (inside a token): search again left of it
    return None


class NgramProposer(Proposer):
    """Prompt lookup: `lookup` for each row, with the configured suffix lengths."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [lookup(r.token_ids, r.max_tokens, self.ngram_min, self.ngram_max) for r in requests]


def make_ngram_proposer(config: SpeculativeConfig) -> NgramProposer:
    """The registered factory of the "ngram" proposer."""
    return NgramProposer(config.ngram_min, config.ngram_max)
