"""A tensor-parallel rank > 0: a spawned process that loads its shard and runs what rank 0 broadcasts.

The worker owns an ordinary `ModelRunner` over its shard (its own KV-cache shard) and no scheduler: rank
0 decides every step and broadcasts it as a command; the worker replays it on its runner, and the
collectives inside the forward pass keep the ranks in step. It never samples. Any error ends the
process with a non-zero status, which rank 0's supervisor turns into an engine error: a rank that went
on after a failed step could only desynchronise the collectives.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..model_runner import ModelRunner
from ..step_inputs import StepInputs
from .group import RankGroups, client_store
from .portable import moved
from .shard import ModelShard

log = logging.getLogger(__name__)
PARENT_CHECK_S = 1.0


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank > 0 needs to build its part (picklable: it crosses the spawn)."""

    rank: int
    world: int
    port: int  # rank 0's TCP store on the loopback interface
    source: str
    dtype: str  # rank 0's model dtype, never "auto": every rank computes in the same one
    native_kernel: bool | None  # rank 0's packed-weights kernel: native or torch's (None: nothing packed)
    quantization: str
    max_model_len: int | None  # what rank 0 was asked to serve: the positions may depend on it (LongRoPE)
    device: str
    ops_kind: str | None
    architectures: Mapping[str, Any]
    block_size: int
    num_blocks: int
    kv_cache_dtype: torch.dtype
    tile_rule: str  # rank 0's rule for the AMX tiles (native/tile_rows.py): every rank multiplies alike
    threads: int
    log_level: int
    parent_pid: int


class RankWorker:
    """Replays rank 0's commands on this rank's runner; `COMMANDS` are the only names it answers."""

    COMMANDS = frozenset({"forward", "logits", "copy_blocks", "sleep", "wakeup"})

    def __init__(self, spec: WorkerSpec, groups: RankGroups, shard: ModelShard) -> None:
        self.spec, self.groups, self.shard = spec, groups, shard
        self.device = torch.device(spec.device)
        loaded = self.load()
        self.runner = ModelRunner(loaded.model, block_size=spec.block_size, num_blocks=spec.num_blocks,
                                  device=self.device, dtype=loaded.dtype, kv_cache_dtype=spec.kv_cache_dtype,
                                  tile_rule=spec.tile_rule)

    def load(self) -> Any:
        from ..kernels import select_ops
        from ..loader import DTYPES, load_checkpoint
        from ..native.library import available
        from ..quant.kernel_choice import PackedKernel

        spec = self.spec
        packed = (None if spec.native_kernel is None
                  else PackedKernel(available() if spec.native_kernel else None, DTYPES[spec.dtype]))
        return load_checkpoint(spec.source, dtype=spec.dtype, device=self.device,
                               architectures=spec.architectures, ops=select_ops(self.device, spec.ops_kind),
                               quantization=spec.quantization, shard=self.shard, packed_choice=packed,
                               max_model_len=spec.max_model_len)

    def serve(self) -> None:
        """Run commands until rank 0 broadcasts None (stop), or until rank 0 is gone."""
        while True:
            try:
                command = self.groups.broadcast_object()
            except RuntimeError as exc:  # its sockets closed: it exited or was killed
                log.error("rank %d: rank 0 is gone (%s); exiting", self.spec.rank, str(exc).splitlines()[0])
                sys.exit(1)
            if command is None:
                return
            name, args = command
            if name not in self.COMMANDS:
                raise ValueError(f"unknown tensor-parallel command {name!r}")
            getattr(self, name)(*args)

    def forward(self, inputs: StepInputs) -> None:
        inputs = _to_device(inputs, self.device)
        self.runner.zero_blocks(inputs.meta.block_tables.flatten().tolist())  # what rank 0's prepare zeroed
        self.runner.forward(inputs)

    def logits(self, hidden: torch.Tensor) -> None:
        self.runner.logits(hidden.to(self.device))

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        self.runner.copy_blocks(copies)

    def sleep(self, level: int) -> None:
        self.runner.sleep(level)
        self.groups.all_ok(True)

    def wakeup(self, tags: Sequence[str]) -> None:
        self.runner.wakeup(tags, lambda: self.load().model)
        self.groups.all_ok(True)


def main() -> None:
    """``python -c "...worker import main; main()"`` (supervisor.py): the `WorkerSpec` pickled on stdin."""
    import pickle

    worker_main(pickle.load(sys.stdin.buffer))


def worker_main(spec: WorkerSpec) -> None:
    """The spawned process's entry point: join the groups, load, say ready, serve; exit 1 on any error."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 stops us
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s rank {spec.rank} %(name)s %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_parent, args=(spec.parent_pid,), daemon=True).start()
    torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = client_store(spec.port, spec.world)
    store.set(f"joined/{spec.rank}", "1")
    groups = RankGroups(spec.rank, spec.world)
    groups.connect(store, device)
    try:
        worker = RankWorker(spec, groups, ModelShard(groups))
    except BaseException as exc:
        log.exception("rank %d failed to start", spec.rank)
        store.set(f"error/{spec.rank}", f"{type(exc).__name__}: {exc}")
        groups.all_ok(False)
        sys.exit(1)
    if not groups.all_ok(True):
        sys.exit(1)  # another rank failed to start
    try:
        worker.serve()
    except Exception:
        log.exception("rank %d failed; stopping", spec.rank)
        sys.exit(1)


def _exit_with_parent(parent_pid: int) -> None:
    """Rank 0's process is gone (killed without a chance to stop us): exit too."""
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _to_device(inputs: StepInputs, device: torch.device) -> StepInputs:
    return inputs if device.type == "cpu" else moved(inputs, device)
