"""CUDA graphs for decode steps: one captured forward per batch size, replayed with padded inputs.

A decode step (one new token per sequence) launches a few hundred small kernels; on a GPU their launch
overhead, not the weight reads, bounds small batches. At start-up (and again whenever the weights or the
KV cache were re-allocated, i.e. after a wakeup) the model's decode forward is captured for each size in
:func:`capture_sizes`, all graphs sharing one memory pool. A step with ``n`` sequences is padded to the
next captured size: padding rows write nowhere (slot -1) and attend to one harmless cached token
(sequence length 1, block 0). Prefill and mixed steps, batches above the largest size, image embeddings and
M-RoPE positions run eagerly.

Only an op set that never syncs with the host in a decode step (``ops.graph_safe``: the Triton set) can
be captured; with any other set, on the CPU, or with the backend option ``enforce_eager`` (``--enforce-eager``)
:func:`make_decode_graphs` returns None and nothing here runs.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.layers.attention import attention_layers
from core_pytorch_backend.layers.recurrent import recurrent_layers
from core_pytorch_backend.step_inputs import StepInputs

log = logging.getLogger(__name__)
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
WARMUP_RUNS = 2  # compiles the Triton kernels and warms cuBLAS before capture


class Replayable(Protocol):
    def replay(self) -> None: ...


def capture_sizes(max_num_seqs: int, sizes: Sequence[int] = BATCH_SIZES) -> tuple[int, ...]:
    """The batch sizes to capture: ``sizes`` up to ``max_num_seqs``, plus ``max_num_seqs`` itself when
    it lies below the largest of them (so every batch the scheduler can form up to there is covered)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    chosen = {s for s in sizes if s <= max_num_seqs}
    if max_num_seqs < max(sizes):
        chosen.add(max_num_seqs)
    return tuple(sorted(chosen))


def padded_size(sizes: Sequence[int], batch: int) -> int | None:
    """The smallest captured size holding ``batch`` sequences; None when none does."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeBuffers:
    """The static inputs every captured graph reads; a step's real batch is copied into their heads."""

    input_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    slot_mapping: torch.Tensor  # [max_batch] int64, -1 beyond the real batch
    seq_lens: torch.Tensor  # [max_batch] int32, 1 beyond the real batch
    query_start_loc: torch.Tensor  # [max_batch + 1] int32: 0, 1, 2, ... (one token per sequence)
    block_tables: torch.Tensor  # [max_batch, max_blocks] int32

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device) -> DecodeBuffers:
        def full(value: int, dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=dtype, device=device)

        return cls(
            input_ids=full(0, torch.int64, max_batch),
            positions=full(0, torch.int64, max_batch),
            slot_mapping=full(-1, torch.int64, max_batch),
            seq_lens=full(1, torch.int32, max_batch),
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            block_tables=full(0, torch.int32, max_batch, max_blocks),
        )

    def meta(self, batch: int, block_size: int) -> AttentionMetadata:
        """Metadata over the first ``batch`` rows. Its Python lists are placeholders: graph-safe ops read
        only the tensors."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            max_query_len=1,
            max_seq_len=self.block_tables.shape[1] * block_size,
            query_lens_list=[1] * batch,
            seq_lens_list=[1] * batch,
            block_size=block_size,
            is_decode=True,
        )

    def fill(self, inputs: StepInputs, batch: int) -> None:
        """Copy a decode step's ``n`` sequences into rows ``[0, n)`` and neutralise rows ``[n, batch)``."""
        meta = inputs.meta
        n, width = meta.num_seqs, meta.block_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if batch > n:
            self.input_ids[n:batch].zero_()
            self.positions[n:batch].zero_()
            self.slot_mapping[n:batch].fill_(-1)
            self.seq_lens[n:batch].fill_(1)
            self.block_tables[n:batch].zero_()


class DecodeGraphs:
    """Captured decode forwards of one model, keyed by batch size; see the module docstring."""

    def __init__(self, *, block_size: int, max_model_len: int, max_num_seqs: int, device: torch.device,
                 sizes: Sequence[int] = BATCH_SIZES):
        self.block_size = block_size
        self.device = device
        self.sizes = capture_sizes(max_num_seqs, sizes)
        self.max_blocks = -(-max_model_len // block_size)
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], self.max_blocks, device)
        self.graphs: dict[int, tuple[Replayable, torch.Tensor]] = {}
        self._captured_for: _CaptureKey | None = None
        self._pool: Any = None
        self.failed = False  # the last capture failed: decode eagerly until an explicit try_capture

    @torch.inference_mode()
    def capture(self, model: torch.nn.Module) -> None:
        """(Re)capture every size, largest first so the smaller graphs reuse its pool."""
        self.release()
        for batch in reversed(self.sizes):
            self.graphs[batch] = self._capture_one(model, batch)
        self._captured_for = _CaptureKey.of(model)
        log.info("captured CUDA graphs for decode batch sizes %s", ", ".join(map(str, self.sizes)))

    def release(self) -> None:
        """Drop every graph and its memory (the KV cache or the weights are about to go)."""
        self.graphs.clear()
        self._pool = None
        self._captured_for = None

    def run(self, model: torch.nn.Module, inputs: StepInputs) -> torch.Tensor | None:
        """Hidden states [n, H] of a decode step through its graph, or None when the step runs eagerly."""
        meta = inputs.meta
        eager_only = getattr(inputs, "embed_overrides", None) is not None or inputs.positions.dim() != 1
        if self.failed or not meta.is_decode or eager_only:
            return None
        batch = padded_size(self.sizes, meta.num_seqs)
        if batch is None or meta.block_tables.shape[1] > self.max_blocks:
            return None
        if (self._captured_for is None or not self._captured_for.matches(model)) and not self.try_capture(model):
            return None
        graph, out = self.graphs[batch]
        self.buffers.fill(inputs, batch)
        graph.replay()
        return out[: meta.num_seqs]

    def try_capture(self, model: torch.nn.Module) -> bool:
        """Capture again (weights or KV cache re-allocated since the last capture); False if that fails."""
        try:
            self.capture(model)
        except Exception as exc:  # e.g. out of memory: decode eagerly rather than fail the step
            log.warning("CUDA graph capture failed (%s: %s); decoding eagerly", type(exc).__name__, exc)
            self.release()
            self.failed = True
            return False
        self.failed = False
        return True

    def _capture_one(self, model: torch.nn.Module, batch: int) -> tuple[Replayable, torch.Tensor]:
        """Warm up on a side stream, then capture ``model``'s forward over the first ``batch`` rows."""
        b = self.buffers
        args = (b.input_ids[:batch], b.positions[:batch], b.meta(batch, self.block_size))
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                model(*args)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = model(*args)
        self._pool = graph.pool()
        return graph, out


@dataclass(frozen=True)
class _CaptureKey:
    """What the graphs baked in: the model object, and its weights' and first KV cache's storage."""

    model: torch.nn.Module
    layer: Any  # the model's first attention layer
    weights_ptr: int
    cache_ptr: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> _CaptureKey:
        layer = attention_layers(model)[0]
        return cls(model, layer, next(model.parameters()).data_ptr(), _cache_ptr(layer))

    def matches(self, model: torch.nn.Module) -> bool:
        return (model is self.model and _cache_ptr(self.layer) == self.cache_ptr
                and next(model.parameters()).data_ptr() == self.weights_ptr)


def _cache_ptr(layer: Any) -> int:
    return layer.k_cache.data_ptr() if layer.k_cache is not None else 0


def make_decode_graphs(model: torch.nn.Module, *, device: torch.device, enabled: bool, block_size: int,
                       max_model_len: int, max_num_seqs: int) -> DecodeGraphs | None:
    """Captured decode graphs for ``model`` (KV cache bound), or None where they do not apply.

    None on a non-CUDA device, when disabled (``enforce_eager``), when the model's op set is not
    graph-safe, or when capture fails (logged; serving goes on eagerly).
    """
    if not enabled or device.type != "cuda":
        return None
    if recurrent_layers(model):
        log.info("CUDA graphs off: the model's recurrent layers index their state slots from the host")
        return None
    if not getattr(getattr(model, "ops", None), "graph_safe", False):
        log.info("CUDA graphs off: the model's op set syncs with the host in decode (use the triton set)")
        return None
    graphs = DecodeGraphs(block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          device=device)
    return graphs if graphs.try_capture(model) else None
