"""The ranks' process groups, built on torch.distributed without its global default group.

Two groups over one TCP store on the loopback interface: `compute` (gloo on the CPU, NCCL on GPUs) for
the all-reduces and gathers inside a forward pass, with a timeout, so a rank that stops answering fails
the step instead of hanging it; and `control` (gloo, on the CPU), on which rank 0 broadcasts each command
to the others, who wait there for as long as the engine is idle. A peer that dies closes its sockets,
which fails a pending gloo operation at once. The groups are objects, not torch.distributed's default
group, so several engines (a test session's) can live in one process one after another.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

HOST = "127.0.0.1"  # the ranks of one engine run on one machine
COLLECTIVE_TIMEOUT_S = 300.0  # the longest one rank waits for the others inside a forward pass
CONTROL_TIMEOUT = datetime.timedelta(days=30)  # ranks > 0 wait for the next command as long as it takes
STORE_TIMEOUT = datetime.timedelta(seconds=120)
FRAME_BYTES = 64 << 10  # one broadcast carries a command up to this size (a decode step's is a few KiB)


def master_store(world: int) -> dist.TCPStore:
    """Rank 0's store, on a free loopback port (`store.port`)."""
    return dist.TCPStore(HOST, 0, world, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)


def client_store(port: int, world: int) -> dist.TCPStore:
    return dist.TCPStore(HOST, port, world, is_master=False, timeout=STORE_TIMEOUT)


@dataclass
class RankGroups:
    """This rank's two groups and the collectives the engine uses over them; a model's layers hold it
    from load time (parallel_layers.py) and it is connected before the first forward pass."""

    rank: int
    world: int
    compute: Any = None  # a torch.distributed ProcessGroup (gloo or NCCL)
    control: Any = None  # a gloo ProcessGroup

    def connect(self, store: dist.Store, device: torch.device,
                timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        """Build both groups; every rank calls it, in the same order (it returns once all have)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        self.compute = (_nccl(store, self.rank, self.world, timeout) if device.type == "cuda"
                        else _gloo(dist.PrefixStore("compute", store), self.rank, self.world, timeout))
        self.control = _gloo(dist.PrefixStore("control", store), self.rank, self.world, CONTROL_TIMEOUT)

    def disconnect(self) -> None:
        """Drop the groups (their sockets close when the objects go)."""
        self.compute = self.control = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place."""
        self.compute.allreduce([tensor]).wait()
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `tensor` concatenated along the last dimension, on rank 0 (None elsewhere)."""
        tensor = tensor.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        outputs = [[torch.empty_like(tensor) for _ in range(self.world)]] if self.rank == 0 else []
        self.compute.gather(outputs, [tensor], options).wait()
        return torch.cat(outputs[0], dim=-1) if self.rank == 0 else None

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled; tensors in it should be on the CPU). One broadcast of a
        fixed-size frame (the length, then the bytes) carries a step's inputs; a larger object takes a
        second broadcast for the rest."""
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL) if self.rank == 0 else b""
        if self.rank == 0:
            head = len(data).to_bytes(8, "little") + data[: FRAME_BYTES - 8]
            frame[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self._broadcast(frame)
        if self.rank == 0:
            if len(data) > FRAME_BYTES - 8:
                self._broadcast(torch.frombuffer(bytearray(data[FRAME_BYTES - 8 :]), dtype=torch.uint8))
            return obj
        size = int.from_bytes(frame[:8].numpy().tobytes(), "little")
        data = frame[8 : 8 + size].numpy().tobytes()
        if size > FRAME_BYTES - 8:
            rest = torch.empty(size - (FRAME_BYTES - 8), dtype=torch.uint8)
            self._broadcast(rest)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.control.broadcast([tensor], options).wait()

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank says `ok` (a barrier on the control group)."""
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
        self.control.allreduce([flag]).wait()
        return int(flag.item()) == 0


def _gloo(store: dist.Store, rank: int, world: int, timeout: datetime.timedelta) -> Any:
    gloo = dist.ProcessGroupGloo
    options = gloo._Options()
    options._timeout = timeout
    options._devices = [gloo.create_device(hostname=HOST)]
    return gloo(store, rank, world, options)


def _nccl(store: dist.Store, rank: int, world: int, timeout: datetime.timedelta) -> Any:
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore("compute", store), rank, world, options)
