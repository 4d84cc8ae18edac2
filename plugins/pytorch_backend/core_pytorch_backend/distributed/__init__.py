"""Tensor parallelism over torch.distributed (gloo on the CPU, NCCL on GPUs): ``--tensor-parallel-size N``.

plan.py (what each weight's shard is, and the shape checks), slicing.py (a rank's slice of a checkpoint
tensor, dense or packed), parallel_layers.py (the all-reduces and the gather attached to a loaded
shard), shard.py (the loader's seam), group.py (the process groups), worker.py (ranks 1..N-1),
supervisor.py (their processes), runner.py (rank 0's runner that drives them), launch.py (what the
backend calls). Importing this package starts nothing.
"""

from .launch import TensorParallel

__all__ = ["TensorParallel"]
