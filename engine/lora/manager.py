"""Where adapters live: on the host (read from disk, kept in an LRU) and in the device
slots the LoRA layers read (vLLM's two tiers: `max_cpu_loras` and `max_loras`).

    request names an adapter --(process_request: read and checked once)--> host LRU
    a step runs it           --(SlotTable picks a slot, LRU)-------------> device slot

Rank 0 decides which adapter goes to which slot (`SlotTable`) and sends the loads with the
step's inputs; every rank then copies its own shard from its own host copy, reading the
folder itself if it has none. Adapters that live requests name stay on the host whatever
the limit, so a request never finds its adapter gone.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import torch
from torch import nn

from engine.lora.layers import LoRAMapping, wrap_lora_layers
from engine.lora.peft import LoRAAdapter, load_peft_adapter
from engine.lora.request import LoRARequest


class LoRAModelManager:
    """One rank's adapters: the host LRU and the device slots of every wrapped layer."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.mapping = LoRAMapping(max_loras, device, dtype)
        self.layers = wrap_lora_layers(model, self.mapping, max_lora_rank)
        self.targets = {name: layer.target for name, layer in self.layers.items()}
        self.packed = getattr(model, "packed_modules", {})
        self.fused = getattr(model, "fused_checkpoint_modules", {})
        self.max_lora_rank, self.max_cpu_loras, self.dtype = max_lora_rank, max_cpu_loras, dtype
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slots: list[str | None] = [None] * max_loras
        self.num_disk_loads = 0  # adapters read from their folder
        self.num_slot_loads = 0  # adapters copied into a device slot

    def use_cpu_kernel(self) -> None:
        """Every LoRA layer computes its delta through the native CPU kernel (the CPU
        attention backend has built the library)."""
        for layer in self.layers.values():
            layer.use_cpu_kernel()

    def load(self, request: LoRARequest, pinned: set[str] = frozenset()) -> LoRAAdapter:
        """The adapter from the host LRU, or read from its folder (LoRALoadError if it cannot
        run here). Adapters beyond max_cpu_loras leave the host, oldest first, unless pinned."""
        adapter = self.host.get(request.lora_name)
        if adapter is not None and adapter.path != request.lora_path:
            raise ValueError(f"model: adapter {request.lora_name!r} is loaded from {adapter.path}, "
                             f"not {request.lora_path}")
        if adapter is None:
            adapter = load_peft_adapter(request.lora_name, request.lora_path, self.targets, self.packed, self.fused,
                                        self.max_lora_rank, self.dtype)
            self.num_disk_loads += 1
        self.host[request.lora_name] = adapter
        self.host.move_to_end(request.lora_name)
        keep = set(pinned) | {request.lora_name} | {name for name in self.slots if name is not None}
        for name in [n for n in self.host if n not in keep][: max(0, len(self.host) - self.max_cpu_loras)]:
            del self.host[name]
        return adapter

    def activate(self, slot: int, request: LoRARequest) -> None:
        """Copy the adapter into `slot` of every wrapped layer (this rank's shard)."""
        adapter = self.load(request)
        for name, layer in self.layers.items():
            layer.set_slot(slot, adapter, name)
        self.slots[slot] = request.lora_name
        self.num_slot_loads += 1

    def set_mapping(self, seq_slots: torch.Tensor, lens: torch.Tensor) -> None:
        self.mapping.set(seq_slots, lens)


class SlotTable:
    """Rank 0's record of which adapter sits in which device slot; the least recently used
    slot that no running request needs is the one reloaded."""

    def __init__(self, max_loras: int) -> None:
        self.names: list[str | None] = [None] * max_loras
        self.last_used = [0] * max_loras
        self.clock = 0

    def assign(self, wanted: list[LoRARequest], running: set[str]) -> tuple[dict[str, int], list[tuple[int, LoRARequest]]]:
        """Slots for this step's adapters: (name -> slot, [(slot, adapter to load there)]).
        The scheduler keeps the running requests to max_loras adapters, so a slot is free."""
        self.clock += 1
        slots, loads = {}, []
        for request in {r.lora_name: r for r in wanted}.values():
            name = request.lora_name
            if name in self.names:
                slot = self.names.index(name)
            else:
                busy = {n for n in self.names if n in running} | {r.lora_name for r in wanted}
                free = [s for s, n in enumerate(self.names) if n is None or n not in busy]
                if not free:
                    raise RuntimeError(f"no LoRA slot free for {name!r}: the step needs more than max_loras")
                slot = min(free, key=lambda s: (self.names[s] is not None, self.last_used[s]))
                self.names[slot] = name
                loads.append((slot, request))
            self.last_used[slot] = self.clock
            slots[name] = slot
        return slots, loads


def lora_step_inputs(table: SlotTable | None, seqs: list, running: set[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's (lora_slots [S], lora_loads [B] uint8 JSON) for StepInputs (engine/shard.py)."""
    if table is None or all(seq.lora_request is None for seq in seqs):
        return torch.full((len(seqs),), -1, dtype=torch.int64), torch.zeros(0, dtype=torch.uint8)
    slots, loads = table.assign([seq.lora_request for seq in seqs if seq.lora_request is not None], running)
    seq_slots = torch.tensor([-1 if seq.lora_request is None else slots[seq.lora_name] for seq in seqs])
    payload = json.dumps([[slot, request.lora_name, request.lora_path] for slot, request in loads]).encode()
    return seq_slots, torch.tensor(list(payload), dtype=torch.uint8)
