"""`TensorParallelRunner`: rank 0's runner, with the interface of `ModelRunner` that the engine loop uses.

The engine loop, its scheduler and its sampler run once, here. Every call that touches the model or the
KV cache is first broadcast to the other ranks (`worker.RankWorker` replays it on its own shard), then
run on rank 0's own `ModelRunner`; the collectives inside the forward pass keep the ranks in step, and
rank 0 alone receives the gathered logits. Building a step (`prepare`) stays local: the workers get its
result. Sleep and wakeup end with a barrier, so they return once every rank has freed or restored.

A failure of a collective, or of rank 0's own part of one, leaves the ranks out of step: it is fatal.
The supervisor stops every rank and each later call raises the same `BackendError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from core.errors import BackendError

from ..model_runner import ModelRunner
from ..step_inputs import StepInputs, StepLogits
from .group import RankGroups
from .portable import portable
from .supervisor import RankProcesses

DEATH_GRACE_S = 2.0  # how long a failed collective waits for the supervisor to name the rank that died


def _local(name: str) -> property:
    """A read-only attribute of rank 0's runner."""
    return property(lambda self: getattr(self.local, name), doc=f"`ModelRunner.{name}` of rank 0")


class TensorParallelRunner:
    """Rank 0's `ModelRunner` (`local`) in step with the other ranks' (see the module docstring)."""

    def __init__(self, local: ModelRunner, groups: RankGroups, ranks: RankProcesses, threads: int) -> None:
        self.local = local
        self.groups = groups
        self.ranks = ranks
        self.threads = threads  # rank 0's share of torch's threads, taken by the thread that runs its steps
        self._threads_taken = False
        self._closed = False

    # -- what the engine loop reads: rank 0's (every rank's is the same) ----------------------------

    model = _local("model")
    block_size = _local("block_size")
    num_blocks = _local("num_blocks")
    device = _local("device")
    dtype = _local("dtype")
    kv_memory_is_lazy = _local("kv_memory_is_lazy")
    has_kv_cache = _local("has_kv_cache")
    has_recurrent_state = _local("has_recurrent_state")
    asleep = _local("asleep")

    # -- steps ----------------------------------------------------------------------------------------

    def prepare(self, *args: Any, **kwargs: Any) -> StepInputs:
        """Rank 0's `ModelRunner.prepare`: the other ranks receive the result with `forward`."""
        if not self._threads_taken:  # OpenMP's thread count is the calling thread's: the engine loop's
            torch.set_num_threads(self.threads)
            self._threads_taken = True
        return self.local.prepare(*args, **kwargs)

    def forward(self, inputs: StepInputs) -> StepLogits:
        if not self.local.has_kv_cache:  # the local runner's own error, before any rank is involved
            return self.local.forward(inputs)
        self._broadcast("forward", portable(inputs))
        return self._together(lambda: self.local.forward(inputs))

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        return self.forward(inputs).sample

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._broadcast("logits", hidden.cpu())
        return self._together(lambda: self.local.logits(hidden))

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        if not copies or not self.local.has_kv_cache:
            return
        self._broadcast("copy_blocks", list(copies))
        self._together(lambda: self.local.copy_blocks(copies))

    # -- sleep ----------------------------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        self._broadcast("sleep", level)
        self._together(lambda: self.local.sleep(level))
        self._barrier("sleep")

    def wakeup(self, tags: Iterable[str], load_model: Callable[[], torch.nn.Module]) -> None:
        tags = list(tags)
        self._broadcast("wakeup", tags)
        self._together(lambda: self.local.wakeup(tags, load_model))
        self._barrier("wakeup")

    # -- the ranks ------------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise the engine's failure if a rank died or a collective failed."""
        self.ranks.check()

    def close(self) -> None:
        """Tell the other ranks to stop, wait for them (then kill what is left)."""
        if self._closed:
            return
        self._closed = True
        self.ranks.expect_exit()
        if self.ranks.failure is None:
            try:
                self.groups.broadcast_object(None)
            except Exception:  # a rank died meanwhile: stop() kills the rest
                pass
        self.ranks.stop()
        self.groups.disconnect()

    def _broadcast(self, name: str, *args: Any) -> None:
        self.check()
        self._together(lambda: self.groups.broadcast_object((name, args)))

    def _together(self, fn: Callable[[], Any]) -> Any:
        """`fn()`, a part of a collective step: its failure stops every rank (they are out of step)."""
        try:
            return fn()
        except Exception as exc:
            raise self._failed(exc) from exc

    def _barrier(self, what: str) -> None:
        if not self._together(lambda: self.groups.all_ok(True)):
            raise self.ranks.fail(f"a tensor-parallel rank failed to {what}")

    def _failed(self, exc: Exception) -> BackendError:
        died = self.ranks.wait_for_death(DEATH_GRACE_S)  # a peer's death is the clearer reason
        reason = f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {exc})"
        return died or self.ranks.fail(reason)
