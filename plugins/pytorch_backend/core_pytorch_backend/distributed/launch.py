"""`TensorParallel`: how the pytorch backend serves one model over `--tensor-parallel-size` ranks.

Rank 0 is the backend's own process: it loads its shard like any model (`shard`, passed to the loader,
which checks the tensor-parallel size at that point, before anything is spawned), builds its
`ModelRunner`, and `start` then spawns ranks 1..N-1 (one process each: `worker.py`), connects the
process groups and waits until every rank has loaded its shard and allocated its KV-cache shard of the
same number of blocks. The returned `TensorParallelRunner` is what the engine loop drives.

Each rank runs on its own device (``cuda:i + rank`` for ``--device cuda:i``); on the CPU the ranks share
the machine, so each gets an equal share of torch's threads (rank 0's: its engine thread's).
CUDA graphs and LoRA adapters are not combined with tensor parallelism yet (the first is turned off, the
second refused).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from core.config import EngineConfig
from core.errors import BackendError, InvalidRequestError

from ..kernels import KINDS
from ..model_runner import ModelRunner
from .group import STORE_TIMEOUT, RankGroups, master_store
from .plan import FLAG
from .runner import TensorParallelRunner
from .shard import ModelShard
from .supervisor import RankProcesses
from .worker import WorkerSpec

log = logging.getLogger(__name__)
JOIN_POLL_S = 0.05


class TensorParallel:
    """The backend's ranks (see the module docstring); None of it exists for a size of 1."""

    @classmethod
    def from_config(cls, config: EngineConfig, device: torch.device) -> TensorParallel | None:
        return cls(config, device) if config.tensor_parallel_size > 1 else None

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.world = config.tensor_parallel_size
        if config.adapters.enabled:
            raise InvalidRequestError(f"LoRA adapters cannot be combined with {FLAG} > 1 yet",
                                      param="tensor_parallel_size")
        self.devices = _rank_devices(device, self.world)
        self._threads_before = torch.get_num_threads()
        cpu = device.type == "cpu"
        self.threads = max(1, self._threads_before // self.world) if cpu else self._threads_before
        self.groups = RankGroups(0, self.world)
        self.shard = ModelShard(self.groups)  # rank 0's: the loader builds its part with it
        self.runner: TensorParallelRunner | None = None

    def start(self, local: ModelRunner, *, config: EngineConfig, source: str,
              architectures: Mapping[str, Any], ops_kind: str | None) -> TensorParallelRunner:
        """Spawn ranks 1..N-1 and return the runner that drives them with `local` (rank 0's)."""
        store = master_store(self.world)
        specs = [self._spec(rank, store.port, local, config, source, architectures, ops_kind)
                 for rank in range(1, self.world)]
        ranks = RankProcesses(specs)
        try:
            _wait_for_ranks(store, ranks, self.world)
            if local.device.type == "cuda":
                torch.cuda.set_device(local.device)  # NCCL binds each rank's communicator to its device
            self.groups.connect(store, local.device)
            if not self.groups.all_ok(True):
                raise BackendError(f"tensor-parallel start-up failed: {_start_errors(store, self.world)}")
        except Exception as exc:
            ranks.expect_exit()
            ranks.stop(timeout=0)
            self.groups.disconnect()
            if isinstance(exc, BackendError):
                raise
            raise BackendError(f"tensor-parallel start-up failed ({type(exc).__name__}: {exc}); "
                               f"{_start_errors(store, self.world)}") from exc
        self._store = store  # the groups were built over it; it lives as long as they do
        self.runner = TensorParallelRunner(local, self.groups, ranks, threads=self.threads)
        log.info("tensor parallelism: %d ranks on %s, %d threads each", self.world,
                 ", ".join(str(d) for d in self.devices), self.threads)
        return self.runner

    def check(self) -> None:
        """Raise the engine's failure if a rank died."""
        if self.runner is not None:
            self.runner.check()

    def close(self) -> None:
        """Stop every rank (after the engine loop has stopped)."""
        if self.runner is not None:
            self.runner.close()
            torch.set_num_threads(self._threads_before)  # what threads started from now on get

    def _spec(self, rank: int, port: int, local: ModelRunner, config: EngineConfig, source: str,
              architectures: Mapping[str, Any], ops_kind: str | None) -> WorkerSpec:
        return WorkerSpec(rank=rank, world=self.world, port=port, source=source,
                          dtype=str(local.dtype).replace("torch.", ""),
                          native_kernel=_native_kernel(local.model),
                          quantization=config.quantization, max_model_len=config.max_model_len,
                          device=str(self.devices[rank]),
                          ops_kind=ops_kind if ops_kind in KINDS else None,
                          architectures=dict(architectures), block_size=local.block_size,
                          num_blocks=local.num_blocks, kv_cache_dtype=local.kv_cache_dtype,
                          tile_rule=local.tile_rule, threads=self.threads,
                          log_level=logging.getLogger().getEffectiveLevel(), parent_pid=os.getpid())


def _native_kernel(model: torch.nn.Module) -> bool | None:
    """Whether rank 0's packed layers run the plugin's native kernels (None: it has none): the other ranks
    take the same kernel and dtype, so that their partial results add up."""
    from ..layers.quantized import AffineRows, Int4Weight
    from ..native.packed_weight import NativeWeight
    from ..quant.kernel_choice import packed_kernel

    if not any(isinstance(m, (AffineRows, Int4Weight, NativeWeight)) for m in model.modules()):
        return None
    return packed_kernel().native is not None  # measured (and cached) when rank 0 loaded


def _rank_devices(device: torch.device, world: int) -> list[torch.device]:
    """One device per rank: the CPU for all, or consecutive GPUs from the one named."""
    if device.type == "cpu":
        return [device] * world
    if device.type != "cuda":
        raise InvalidRequestError(f"{FLAG} runs on the CPU or on CUDA GPUs, not on {device.type}",
                                  param="tensor_parallel_size")
    first = device.index or 0
    if first + world > torch.cuda.device_count():
        raise InvalidRequestError(f"{FLAG} {world} from cuda:{first} needs {first + world} GPUs; "
                                  f"{torch.cuda.device_count()} are visible", param="tensor_parallel_size")
    return [torch.device("cuda", first + rank) for rank in range(world)]


def _wait_for_ranks(store: Any, ranks: RankProcesses, world: int) -> None:
    """Until every spawned rank has reached the store (or one died, or the store's timeout passed)."""
    keys = [f"joined/{rank}" for rank in range(1, world)]
    deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
    while not store.check(keys):
        ranks.check()
        if time.monotonic() > deadline:
            seconds = STORE_TIMEOUT.total_seconds()
            raise BackendError(f"tensor-parallel ranks did not start within {seconds:g} s")
        time.sleep(JOIN_POLL_S)


def _start_errors(store: Any, world: int) -> str:
    """What the ranks that failed to start said (their full tracebacks are in their logs)."""
    said = [f"rank {rank}: {store.get(key).decode()}" for rank in range(1, world)
            if store.check([key := f"error/{rank}"])]
    return "; ".join(said) or "a rank exited (see its log)"
