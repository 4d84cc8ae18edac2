"""Pure-Python paged-KV scheduling: sequences, block manager, scheduler (no torch)."""

from core.scheduling.block_manager import BlockManager, hash_block
from core.scheduling.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from core.scheduling.sequence import Sequence, SequenceStatus
from core.scheduling.state_cache import StateCache
from core.scheduling.state_slots import StateSlots

__all__ = [
    "BlockManager",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "StateCache",
    "StateSlots",
    "hash_block",
]
