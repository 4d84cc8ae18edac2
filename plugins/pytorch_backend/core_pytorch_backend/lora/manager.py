"""The adapters a model serves: host copies, `max_loras` resident slots (LRU) and in-use counts.

Reading a folder (`read`) may run on any thread: it only reads the model's shapes. Everything else runs on
the engine loop's thread, between steps, so a slot never changes under a running step. A request takes
its adapter's slot when it is added (`acquire`) and gives it back when it ends (`release`); an adapter
held by a request is never evicted nor unloaded (unload answers 409). When every slot is held by running
requests (`has_slot_for` is False) the loop keeps a request for another adapter waiting until one of them
ends (engine_loop.py), as a request waits for KV blocks.
"""

from __future__ import annotations

import itertools
import logging

import torch
from torch import nn

from core.adapters import AdapterInfo, AdapterPolicy, AdapterRegistry, LoraModule
from core.errors import AdapterInUseError, OverloadedError
from core_pytorch_backend.layers.linear import Linear, MergedLinear
from core_pytorch_backend.lora.layers import LoraLayer, LoraStep
from core_pytorch_backend.lora.peft_folder import AdapterWeights, read_adapter
from core_pytorch_backend.native.library import available as native_kernels

log = logging.getLogger(__name__)


class AdapterManager:
    """See the module docstring. `step` is the row-to-slot map the model's LoRA layers read."""

    def __init__(self, model: nn.Module, policy: AdapterPolicy, device: torch.device, dtype: torch.dtype,
                 weights_dtype: torch.dtype | None = None) -> None:
        self.policy = policy
        self.registry = AdapterRegistry()
        self.device = device
        self.dtype = weights_dtype or dtype  # what the slots hold; the model's activations are in `dtype`
        self.kernels = _native_for(policy, device, dtype)
        self.step = LoraStep(self.dtype, native=self.kernels is not None)
        self.slots: list[str | None] = [None] * policy.max_loras
        self.in_use: dict[str, int] = {}
        self._host: dict[str, AdapterWeights] = {}
        self._last_used: dict[str, int] = {}
        self._clock = itertools.count()
        self.model = model
        self.layers: dict[str, LoraLayer] = {}
        self.attach(model)

    def attach(self, model: nn.Module) -> None:
        """Give every linear layer of `model` its LoRA slots (again after a reload), refilled from host."""
        self.model = model
        self.layers = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear):
                sizes = module.output_sizes if isinstance(module, MergedLinear) else [module.output_size]
                module.lora = self.layers[name] = LoraLayer(self.step, len(self.slots), self.policy.max_lora_rank,
                                                            module.input_size, sizes, self.device, self.dtype, self.kernels)
        for slot, name in enumerate(self.slots):
            if name is not None:
                self._fill(slot, self._host[name])

    # -- loading (read on any thread, add/remove on the loop's) ---------------------------------------

    def read(self, module: LoraModule) -> AdapterWeights:
        """The folder read and checked (a 400 naming the field); nothing is kept yet."""
        if module.name in self.registry:
            self.registry.reserve_key(module.name)  # raises: the name is taken
        return read_adapter(module.path, self.model, self.policy.max_lora_rank)

    def add(self, module: LoraModule, weights: AdapterWeights) -> AdapterInfo:
        info = AdapterInfo(module.name, module.path, weights.rank, self.registry.reserve_key(module.name))
        self.registry.add(info)
        self._host[module.name] = weights
        log.info("LoRA adapter %r loaded from %s (rank %d, %d layers)", module.name, module.path, weights.rank,
                 len(weights.layers))
        return info

    def remove(self, name: str) -> None:
        self.registry.get(name)  # a 404 for an unknown name
        if self.in_use.get(name):
            raise AdapterInUseError(f"the adapter {name!r} is in use by {self.in_use[name]} request(s); unload it "
                                    "when they end", param="lora_name")
        if name in self.slots:
            slot = self.slots.index(name)
            self.slots[slot] = None
            for layer in self.layers.values():
                layer.clear(slot)
        self.registry.remove(name)
        self._host.pop(name, None)
        self._last_used.pop(name, None)
        self.in_use.pop(name, None)
        log.info("LoRA adapter %r unloaded", name)

    # -- per request (the loop's thread) --------------------------------------------------------------

    def key(self, name: str) -> str:
        """The adapter's prefix-cache key (a 404 for an unknown name)."""
        return self.registry.get(name).key

    def has_slot_for(self, name: str) -> bool:
        """Whether `acquire(name)` finds a slot now: resident, free, or held by an idle adapter."""
        self.registry.get(name)  # a 404 for an unknown name
        return name in self.slots or any(n is None or not self.in_use.get(n) for n in self.slots)

    def acquire(self, name: str) -> tuple[int, str]:
        """The slot holding adapter `name` for one more request, and the adapter's prefix-cache key."""
        info = self.registry.get(name)
        slot = self.slots.index(name) if name in self.slots else self._make_resident(name)
        self.in_use[name] = self.in_use.get(name, 0) + 1
        self._last_used[name] = next(self._clock)
        return slot, info.key

    def release(self, name: str) -> None:
        if self.in_use.get(name, 0) > 0:
            self.in_use[name] -= 1

    def slots_in_use(self) -> int:
        """Slots held by running requests (0 when idle: the leak check)."""
        return sum(1 for name in self.slots if name is not None and self.in_use.get(name))

    def _make_resident(self, name: str) -> int:
        slot = self._free_slot()
        evicted = self.slots[slot]
        if evicted is not None:
            log.debug("LoRA slot %d: %r evicted for %r", slot, evicted, name)
        self.slots[slot] = name
        self._fill(slot, self._host[name])
        return slot

    def _free_slot(self) -> int:
        if None in self.slots:
            return self.slots.index(None)
        idle = [(self._last_used.get(n, -1), i) for i, n in enumerate(self.slots) if not self.in_use.get(n)]
        if not idle:
            raise OverloadedError(f"all {len(self.slots)} LoRA slots (--max-loras) are in use by running requests")
        return min(idle)[1]

    def _fill(self, slot: int, weights: AdapterWeights) -> None:
        for name, layer in self.layers.items():
            shards = weights.layers.get(name)
            if shards:
                layer.load(slot, shards)
            else:
                layer.clear(slot)


def _native_for(policy: AdapterPolicy, device: torch.device, dtype: torch.dtype):
    """The native CPU kernels where they take this model's adapters (float32 activations on the CPU, ranks
    up to the kernel's maximum), else None: the torch ops (lora/layers.py)."""
    kernels = native_kernels() if device.type == "cpu" and dtype == torch.float32 else None
    if kernels is not None and policy.max_lora_rank > kernels.function("core_lora_max_rank")():
        return None
    return kernels
