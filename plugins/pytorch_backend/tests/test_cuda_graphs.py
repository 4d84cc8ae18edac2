"""Decode CUDA graphs (cuda_graphs.py).

On the CPU a stand-in "graph" replays by re-running the model over the static buffers it was captured
with, which checks everything but the CUDA capture itself: the padding, the buffer copies, the runner
integration, release and re-capture, with the Triton op set (interpreted) that real graphs capture.
The same scenario runs with real CUDA graphs under ``-m gpu``.
"""

from __future__ import annotations

import pytest
import torch

from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.cuda_graphs import (
    BATCH_SIZES,
    DecodeGraphs,
    capture_sizes,
    make_decode_graphs,
    padded_size,
)
from core_pytorch_backend.kernels import select_ops
from core_pytorch_backend.model_runner import ModelRunner, StepInputs

BLOCK = 4
TABLES = [[7, 3, 12], [0, 9, 4], [5, 1, 14]]  # three sequences, shuffled blocks
PROMPTS = [[5, 80, 17, 200, 33], [9, 101, 7], [250, 4, 60, 61, 62, 63, 1]]


class EagerReplayGraphs(DecodeGraphs):
    """Replays by re-running the model over the captured static buffers (no GPU needed)."""

    def _capture_one(self, model, batch):
        b = self.buffers
        args = (b.input_ids[:batch], b.positions[:batch], b.meta(batch, self.block_size))
        out = model(*args).clone()

        class Replay:
            def replay(self) -> None:
                out.copy_(model(*args))

        return Replay(), out


def test_capture_sizes_and_padding():
    assert capture_sizes(256) == BATCH_SIZES
    assert capture_sizes(1000) == BATCH_SIZES  # larger batches run eagerly
    assert capture_sizes(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100)
    assert capture_sizes(3) == (1, 2, 3)
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)
    assert [padded_size((1, 2, 4, 8), n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]


def test_make_decode_graphs_is_off_on_cpu_when_disabled_and_for_unsafe_ops():
    model = torch.nn.Linear(2, 2)
    model.ops = select_ops("cpu", kind="reference")  # syncs with the host: not capturable
    common = dict(block_size=16, max_model_len=64, max_num_seqs=8)
    assert make_decode_graphs(model, device=torch.device("cpu"), enabled=True, **common) is None
    assert make_decode_graphs(model, device=torch.device("cuda"), enabled=False, **common) is None
    assert make_decode_graphs(model, device=torch.device("cuda"), enabled=True, **common) is None


def _step(chunks, computed, device) -> StepInputs:
    meta = AttentionMetadata.build(computed, [len(c) for c in chunks], TABLES[: len(chunks)], BLOCK, device)
    return StepInputs(
        input_ids=torch.tensor([t for c in chunks for t in c], device=device),
        positions=meta.positions(),
        meta=meta,
        sample_indices=meta.last_token_indices(),
        sampling=[None] * len(chunks),  # execute only counts them
    )


def _runner(path, device) -> ModelRunner:
    from core_pytorch_backend.loader import load_checkpoint

    loaded = load_checkpoint(path, dtype="float32", device=device, ops=select_ops(device, kind="triton"))
    return ModelRunner(loaded.model, block_size=BLOCK, num_blocks=16, device=torch.device(device),
                       dtype=torch.float32)


def _decode_through_graphs(runner: ModelRunner, graphs: DecodeGraphs, device: str) -> None:
    """Prefill 3 sequences eagerly, then decode them through a graph padded to 4 rows, and again after
    the KV cache was freed and re-allocated; each time equal to the eager step, and no cache write
    outside the 3 real slots."""
    runner.decode_path = graphs
    graphs.capture(runner.model)
    prefill = _step(PROMPTS, [0, 0, 0], device)
    assert graphs.run(runner.model, prefill) is None  # not a decode step
    first = runner.execute(prefill).argmax(-1).tolist()
    decode = _step([[t] for t in first], [len(p) for p in PROMPTS], device)
    before = [k.clone() for k, _ in runner.kv_caches]
    through_graph = runner.execute(decode)
    written = sum(int((k != b).any(-1).any(-1).sum()) for (k, _), b in zip(runner.kv_caches, before, strict=True))
    assert written == 3 * len(before)  # one slot per real sequence and layer; padding wrote nothing
    runner.decode_path = None
    eager = runner.execute(decode)  # rewrites the same slots with the same values
    torch.testing.assert_close(through_graph, eager, atol=1e-5, rtol=1e-5)

    runner.decode_path = graphs
    runner.free_kv_cache()
    assert not graphs.graphs  # released with the cache
    runner.allocate_kv_cache()
    runner.execute(prefill)
    torch.testing.assert_close(runner.execute(decode), eager, atol=1e-5, rtol=1e-5)  # re-captured lazily
    assert set(graphs.graphs) == {4}


def test_decode_graphs_pad_replay_and_recapture_on_cpu(tiny_checkpoint_factory):
    runner = _runner(tiny_checkpoint_factory("llama"), "cpu")
    graphs = EagerReplayGraphs(block_size=BLOCK, max_model_len=12, max_num_seqs=4, device=torch.device("cpu"),
                               sizes=(4,))
    _decode_through_graphs(runner, graphs, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_graphs_on_cuda(tiny_checkpoint_factory):
    runner = _runner(tiny_checkpoint_factory("llama"), "cuda")
    graphs = DecodeGraphs(block_size=BLOCK, max_model_len=12, max_num_seqs=4, device=torch.device("cuda"),
                          sizes=(4,))
    _decode_through_graphs(runner, graphs, "cuda")
