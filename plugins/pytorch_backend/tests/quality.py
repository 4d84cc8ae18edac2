"""Teacher-forced accuracy of a loaded model on real text: how closely one load follows another.

Used by ``test_quant_accuracy.py`` and ``benchmarks/quant_accuracy.py`` (which loads this file by path:
pytest runs with ``--import-mode=importlib``, so neither finds it on ``sys.path``).

- ``reference_tokens(tokenizer, n)``: ``n + 1`` tokens of English prose that ships with every Python
  install, the Python documentation's help topics (``pydoc_data.topics``: the language reference pages
  that ``help("assert")`` shows), concatenated in sorted key order and tokenized by the model's own
  tokenizer. Offline and deterministic for one Python version; another version's topics differ a little,
  which the relative thresholds (candidate vs oracle on the same tokens) do not care about.
- ``teacher_forced(loaded, tokens)``: runs the model over the tokens with the backend's own paged KV
  cache (chunked prefill, the sequence's block table growing chunk by chunk, as the scheduler grows it)
  and returns, for every position but the last, the float32 log-probability of the actual next token and
  the argmax prediction.
- ``compare(candidate, oracle)``: top-1 agreement and both perplexities.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.layers.attention import allocate_kv_caches, unbind_kv_caches
from core_pytorch_backend.native import tile_rows

DEFAULT_TOKENS = 2000  # positions scored (the text has one more token: the last one is only a target)
CHUNK = 256  # prefill chunk (tokens per forward)
BLOCK_SIZE = 16


def reference_text() -> str:
    """The Python documentation's help topics, in sorted key order, one blank line apart."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def reference_tokens(tokenizer: Any, n_tokens: int = DEFAULT_TOKENS) -> list[int]:
    """The first ``n_tokens + 1`` tokens of ``reference_text()`` (no special tokens added)."""
    text = reference_text()
    chars = 8 * (n_tokens + 1)  # English prose runs ~4-5 characters a token: tokenize only a prefix
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        # the prefix's last token may be a word cut short: keep a margin of tokens beyond the ones used
        if len(ids) > n_tokens + 8 or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n_tokens + 1:
        raise ValueError(f"the reference text has {len(ids)} tokens, fewer than the {n_tokens + 1} asked for")
    return ids[: n_tokens + 1]


@dataclass(frozen=True)
class TeacherForced:
    """One model's predictions at each position ``i`` of a token sequence (for token ``i + 1``)."""

    logprobs: torch.Tensor  # [N] float32: log p(token[i + 1] | tokens[: i + 1])
    argmax: torch.Tensor  # [N] int64: the most likely next token
    margin: torch.Tensor  # [N] float32: log-prob gap between the two likeliest next tokens
    seconds: float = 0.0  # the forward passes' wall time

    @property
    def nll(self) -> float:
        return float(-self.logprobs.double().mean())

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


@torch.inference_mode()
def teacher_forced(loaded: Any, tokens: Sequence[int], chunk: int = CHUNK,
                   block_size: int = BLOCK_SIZE, prompt: bool = True) -> TeacherForced:
    """Score ``tokens`` with a ``LoadedModel`` (from ``load_checkpoint``) through its paged KV cache.

    One sequence, prefilled ``chunk`` tokens at a time; before each chunk the block table grows to the
    blocks the sequence then needs (block ids handed out in reverse, so they are not the identity map).
    Logits are computed for every row of every chunk, in float32 (``compute_logits``). ``prompt``: the
    rows are a prompt's tokens, as the model runner marks a prefill's (``native/tile_rows.py``: where the
    packed weights have AMX tiles, they take them); False: as generated tokens (the VNNI loop).
    """
    model, device = loaded.model, _device_of(loaded.model)
    tokens = list(tokens)
    if len(tokens) < 2:
        raise ValueError("teacher forcing needs at least 2 tokens")
    if len(tokens) > loaded.max_model_len:
        raise ValueError(f"{len(tokens)} tokens exceed the model's context of {loaded.max_model_len}")
    num_blocks = -(-len(tokens) // block_size)
    free_blocks = list(range(num_blocks))[::-1]
    allocate_kv_caches(model, num_blocks, block_size, loaded.kv_cache_dtype, device)  # as served
    table: list[int] = []
    logprobs, argmax, margin = [], [], []
    start = time.perf_counter()
    try:
        for begin in range(0, len(tokens) - 1, chunk):  # the last token is only ever a target
            ids = tokens[begin : min(begin + chunk, len(tokens) - 1)]
            while len(table) * block_size < begin + len(ids):
                table.append(free_blocks.pop())
            meta = AttentionMetadata.build([begin], [len(ids)], [table], block_size, device)
            with tile_rows.prompt_token_rows(tile_rows.rows_of([(0, len(ids))], len(ids)) if prompt else None):
                hidden = model(torch.tensor(ids, dtype=torch.int64, device=device), meta.positions(), meta)
            logits = model.compute_logits(hidden).float()
            targets = torch.tensor(tokens[begin + 1 : begin + 1 + len(ids)], dtype=torch.int64, device=device)
            logprobs.append(logits.log_softmax(-1).gather(1, targets[:, None])[:, 0].cpu())
            top2 = logits.topk(2, dim=-1)
            argmax.append(top2.indices[:, 0].cpu())
            margin.append((top2.values[:, 0] - top2.values[:, 1]).cpu())
    finally:
        unbind_kv_caches(model)
    return TeacherForced(torch.cat(logprobs), torch.cat(argmax), torch.cat(margin), time.perf_counter() - start)


@dataclass(frozen=True)
class Comparison:
    agreement: float  # fraction of positions whose argmax equals the oracle's
    perplexity: float
    oracle_perplexity: float
    positions: int

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity / self.oracle_perplexity

    def __str__(self) -> str:
        return (f"top-1 agreement {self.agreement:.4f} over {self.positions} positions, perplexity "
                f"{self.perplexity:.4f} vs {self.oracle_perplexity:.4f} (ratio {self.perplexity_ratio:.4f})")


def compare(candidate: TeacherForced, oracle: TeacherForced) -> Comparison:
    if candidate.argmax.shape != oracle.argmax.shape:
        raise ValueError(f"scored {candidate.argmax.numel()} vs {oracle.argmax.numel()} positions")
    return Comparison(
        agreement=float((candidate.argmax == oracle.argmax).double().mean()),
        perplexity=candidate.perplexity,
        oracle_perplexity=oracle.perplexity,
        positions=oracle.argmax.numel(),
    )


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (packed codes included), each storage counted once."""
    seen: set[int] = set()
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _device_of(model: torch.nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")
