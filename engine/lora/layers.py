"""LoRA-aware linears: the base layer's output plus each token's adapter delta, so one step
mixes adapters (punica's idea, as vLLM and S-LoRA run it).

Every wrapped linear holds `max_loras` slots of stacked adapter weights, zero where a slot
is empty or its adapter leaves the module alone:

    lora_a  [L, P * R, in]    slot, (part, rank), input features  (this rank's shard of them)
    lora_b  [L, out, R]       slot, output features, rank          (part p's rows at its offset)

P is the number of projections the linear merges (q/k/v: 3, gate/up: 2, else 1) and R is
max_lora_rank; smaller adapters are zero-padded. The delta of a token in slot s is

    shrink:  s_tok = x_tok @ lora_a[s].T           [P * R]
    expand:  out_tok[part p] += s_tok[p] @ lora_b[s, rows of p].T

Three ways to compute it, chosen like the other layers' kernels:
- the Triton kernel (kvfleet_kernels/lora.py: SGMV over the step's sequences, each one segment of
  one slot) on CUDA;
- the native CPU kernel (kvfleet_kernels/cpu_layers.py: add_lora, BGMV: each token reads its own
  slot's A and B, no gather, no padding, no scatter) with the CPU attention backend, which
  builds the native library;
- otherwise (CUDA without the Triton layers, or no compiler), the step's tokens grouped by slot: one
  batched matmul over the slots in use for shrink and one for expand (B laid out so each
  part's rank rows feed only its own columns), each delta then added at its token; a matmul
  pair per slot when the groups are too uneven to pad (a long prefill beside a few decodes).
  Few large calls: at decode sizes a call's fixed cost, paid once per adapter, would dominate.
Under tensor parallelism an adapter is sharded like the layer it modifies: a column-parallel
layer keeps its own rows of B (A whole), a row-parallel one its columns of A (B whole), and
its delta joins the partial product before the all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel
from engine.devices import repeat_interleave
from engine.lora.peft import LoRAAdapter, TargetModule
from engine.models.parallel_layers import ColumnParallelLinear, RowParallelLinear
from engine.quantized_linear import QuantizedLinear
from kvfleet_kernels import reference


@dataclass
class SlotGroups:
    """The step's adapter tokens grouped by slot, as the CPU path reads them.

    batched: `tokens` [G * W] lists each group's tokens padded to the largest group's W with
    its first token again (`padding` [G, W, 1] zeroes those places; None when nothing is
    padded). Otherwise (padding would more than double the rows) `token_lists` per slot."""

    slots: torch.Tensor  # [G] the slots some token uses, ascending
    slot_list: list[int]
    token_lists: list[torch.Tensor]  # per group: its token rows
    batched: bool
    every_slot: bool  # G == max_loras: the slot weights need no selection
    width: int = 0
    tokens: torch.Tensor | None = None
    padding: torch.Tensor | None = None


def group_by_slot(token_slots: torch.Tensor, max_loras: int, device: torch.device, dtype: torch.dtype) -> SlotGroups:
    """token_slots [T] (host, -1: none) -> SlotGroups on `device`."""
    slot_list = sorted(set(token_slots[token_slots >= 0].tolist()))
    token_lists = [torch.nonzero(token_slots == slot).squeeze(1) for slot in slot_list]
    counts = [len(tokens) for tokens in token_lists]
    width = max(counts)
    batched = len(slot_list) * width <= max(64, 2 * sum(counts))
    groups = SlotGroups(torch.tensor(slot_list, device=device), slot_list, [t.to(device) for t in token_lists],
                        batched, len(slot_list) == max_loras, width)
    if batched:
        padded = torch.stack([torch.cat([t, t[:1].expand(width - len(t))]) for t in token_lists])  # [G, W]
        groups.tokens = padded.flatten().to(device)
        if min(counts) < width:
            valid = torch.arange(width)[None, :] < torch.tensor(counts)[:, None]
            groups.padding = valid[:, :, None].to(device=device, dtype=dtype)
    return groups


class LoRAMapping:
    """Which slot each token of the step uses; shared by every LoRA layer, set once per step
    (vLLM's punica wrapper). Slot -1: the base model."""

    def __init__(self, max_loras: int, device: torch.device, dtype: torch.dtype) -> None:
        self.max_loras, self.device, self.dtype = max_loras, device, dtype
        self.active = False  # some token of this step uses an adapter
        self.slot_in_use = [False] * max_loras  # slots some token uses
        self.seg_starts = self.seg_slots = None  # the Triton path's segments
        self.token_slots: torch.Tensor | None = None
        self._groups: SlotGroups | None = None

    @property
    def groups(self) -> SlotGroups:
        """The torch path's groups (the CPU's; CUDA's without the Triton layers), built once a step
        on first use: the Triton path never builds them."""
        if self._groups is None:
            self._groups = group_by_slot(self.token_slots, self.max_loras, self.device, self.dtype)
        return self._groups

    def set(self, seq_slots: torch.Tensor, lens: torch.Tensor) -> None:
        """seq_slots [S] (host, -1: none), lens [S] tokens of each sequence this step."""
        used = seq_slots >= 0
        self.active = bool(used.any())
        if not self.active:
            return
        in_use = set(seq_slots[used].tolist())
        self.slot_in_use = [slot in in_use for slot in range(self.max_loras)]
        starts = torch.zeros(len(lens) + 1, dtype=torch.int64)
        starts[1:] = lens.cumsum(0)
        self.seg_starts, self.seg_slots = starts.to(self.device), seq_slots.to(self.device)
        self.token_slots, self._groups = repeat_interleave(seq_slots, lens), None  # [T] host


class LinearWithLoRA(nn.Module):
    """A linear (plain, oneDNN-packed, low precision, kept quantized or column-parallel: `base`) plus the
    LoRA delta. `in_range`: the input features this rank's A columns cover; `out_ranges`:
    per part, the rows of the part's full output this rank holds (B's rows)."""

    def __init__(self, base: nn.Module, mapping: LoRAMapping, max_rank: int, target: TargetModule,
                 in_range: tuple[int, int], out_ranges: list[tuple[int, int]]) -> None:
        super().__init__()
        self.base, self.mapping, self.max_rank, self.target = base, mapping, max_rank, target
        self.in_range, self.out_ranges = in_range, out_ranges
        self.out_sizes = [end - start for start, end in out_ranges]
        self.out_offsets = [sum(self.out_sizes[:p]) for p in range(len(out_ranges))]
        num_slots, num_parts = mapping.max_loras, len(out_ranges)
        factory = {"device": mapping.device, "dtype": mapping.dtype}
        self.register_buffer("lora_a", torch.zeros(num_slots, num_parts * max_rank, in_range[1] - in_range[0],
                                                   **factory), persistent=False)
        self.register_buffer("lora_b", torch.zeros(num_slots, sum(self.out_sizes), max_rank, **factory),
                             persistent=False)
        self.cpu_weights: tuple[torch.Tensor, torch.Tensor] | None = None  # cpu_operands(), rebuilt on a slot change
        self.slot_filled = [False] * num_slots  # the slot's adapter modifies this module
        self.kernel = None  # kvfleet_kernels/lora.py's sgmv once use_triton_kernel() ran
        self.cpu_kernel = None  # kvfleet_kernels/cpu_layers.py's add_lora once use_cpu_kernel() ran
        self.lora_b_t: torch.Tensor | None = None  # [L, R, out]: the native kernel's B, rebuilt on a slot change
        self.part_offsets = [*self.out_offsets, sum(self.out_sizes)]

    def use_triton_kernel(self) -> None:
        from kvfleet_kernels.lora import sgmv  # noqa: PLC0415 (imports triton)

        self.kernel = sgmv

    def use_cpu_kernel(self) -> None:
        from kvfleet_kernels.cpu_layers import add_lora  # noqa: PLC0415 (builds the native library)

        self.cpu_kernel = add_lora

    def set_slot(self, slot: int, adapter: LoRAAdapter | None, module_name: str) -> None:
        """Copy this rank's shard of `adapter`'s weights for this module into `slot` (zeros
        when it leaves the module alone, or when `adapter` is None: the slot is emptied)."""
        parts = adapter.modules.get(module_name, {}) if adapter is not None else {}
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        rank, (in_start, in_end) = self.max_rank, self.in_range
        for part, (a, b) in parts.items():
            r = a.shape[0]
            self.lora_a[slot, part * rank: part * rank + r].copy_(a[:, in_start:in_end])
            start, end = self.out_ranges[part]
            offset = self.out_offsets[part]
            self.lora_b[slot, offset: offset + end - start, :r].copy_(b[start:end])
        self.slot_filled[slot] = bool(parts)
        self.cpu_weights = self.lora_b_t = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]"""
        return self.add_lora(x, self.base(x))

    def add_lora(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [T, out] plus each token's delta (in place)."""
        mapping = self.mapping
        if not mapping.active or not any(f and u for f, u in zip(self.slot_filled, mapping.slot_in_use)):
            return out
        if self.kernel is not None:
            return self._add_lora_sgmv(x, out)
        if self.cpu_kernel is not None and x.device.type == "cpu":
            if self.lora_b_t is None:
                self.lora_b_t = self.lora_b.transpose(1, 2).contiguous()
            return self.cpu_kernel(out, x, self.lora_a, self.lora_b_t, mapping.token_slots, self.part_offsets)
        return self._add_lora_grouped(x, out)

    def cpu_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU path's weights, rebuilt when a slot changes: A per slot [L, in, P * R], and
        B per slot [L, P * R, out] with part p's R rows feeding only part p's columns."""
        if self.cpu_weights is None:
            num_slots, rank = self.mapping.max_loras, self.max_rank
            a_t = self.lora_a.transpose(1, 2).float().contiguous()
            b_t = a_t.new_zeros(num_slots, len(self.out_ranges) * rank, sum(self.out_sizes))
            for part, (offset, size) in enumerate(zip(self.out_offsets, self.out_sizes)):
                b_t[:, part * rank: (part + 1) * rank, offset: offset + size] = \
                    self.lora_b[:, offset: offset + size].transpose(1, 2)
            self.cpu_weights = a_t, b_t
        return self.cpu_weights

    def _add_lora_grouped(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Tokens grouped by slot: one batched matmul over the step's slots for shrink, one for
        expand, then each delta added at its token; or, when the groups are too uneven to pad
        (a long prefill beside a few decodes), a matmul pair per slot."""
        a_t, b_t = self.cpu_operands()
        groups = self.mapping.groups
        x = x.to(a_t.dtype)
        if groups.batched:
            if not groups.every_slot:
                a_t, b_t = a_t.index_select(0, groups.slots), b_t.index_select(0, groups.slots)
            gathered = x.index_select(0, groups.tokens).view(len(groups.slots), groups.width, -1)  # [G, W, in]
            shrunk = torch.bmm(gathered, a_t)  # [G, W, P * R]
            if groups.padding is not None:
                shrunk.mul_(groups.padding)  # padded places (a repeated token) add nothing
            out.index_add_(0, groups.tokens, torch.bmm(shrunk, b_t).view(-1, out.shape[1]).to(out.dtype))
            return out
        for slot, tokens in zip(groups.slot_list, groups.token_lists):
            delta = x.index_select(0, tokens) @ a_t[slot] @ b_t[slot]  # [n, out]
            out.index_add_(0, tokens, delta.to(out.dtype))
        return out

    def _add_lora_sgmv(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        mapping, rank = self.mapping, self.max_rank
        shrunk = torch.zeros(x.shape[0], self.lora_a.shape[1], device=x.device, dtype=self.lora_a.dtype)
        self.kernel(x.to(self.lora_a.dtype), self.lora_a, shrunk, mapping.seg_starts, mapping.seg_slots)
        for part, (offset, size) in enumerate(zip(self.out_offsets, self.out_sizes)):
            self.kernel(shrunk[:, part * rank: (part + 1) * rank], self.lora_b[:, offset: offset + size],
                        out[:, offset: offset + size], mapping.seg_starts, mapping.seg_slots, accumulate=True)
        return out


class RowParallelLinearWithLoRA(LinearWithLoRA):
    """A row-parallel base (tensor parallelism): the delta of this rank's input columns joins
    the partial product, and one all-reduce sums both."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        partial = self.add_lora(x, F.linear(x, base.weight))
        out = parallel.all_reduce(partial)
        return out + base.bias if base.bias is not None else out


def reference_delta(x: torch.Tensor, layer: LinearWithLoRA) -> torch.Tensor:
    """The delta through kvfleet_kernels/reference.py's per-segment loop (the tests' oracle)."""
    mapping, rank = layer.mapping, layer.max_rank
    shrunk = reference.sgmv(x, layer.lora_a, torch.zeros(x.shape[0], layer.lora_a.shape[1], dtype=x.dtype),
                            mapping.seg_starts, mapping.seg_slots)
    out = torch.zeros(x.shape[0], sum(layer.out_sizes), dtype=x.dtype)
    for part, (offset, size) in enumerate(zip(layer.out_offsets, layer.out_sizes)):
        reference.sgmv(shrunk[:, part * rank: (part + 1) * rank], layer.lora_b[:, offset: offset + size],
                       out[:, offset: offset + size], mapping.seg_starts, mapping.seg_slots, accumulate=True)
    return out


def lora_targets(model: nn.Module) -> dict[str, tuple[nn.Module, nn.Module, str]]:
    """The linears LoRA applies to: those of the decoder layers (attention and MLP
    projections), not an MoE's experts or router: engine name -> (parent, linear, attribute)."""
    targets = {}
    for parent_name, parent in model.named_modules():
        for attribute, child in parent.named_children():
            name = f"{parent_name}.{attribute}" if parent_name else attribute
            in_layer = ".layers." in f".{name}" and "experts" not in name and attribute not in ("gate", "router")
            if in_layer and isinstance(child, nn.Linear | RowParallelLinear | QuantizedLinear):
                targets[name] = (parent, child, attribute)
    return targets


def ranges(sizes: list[int]) -> list[tuple[int, int]]:
    """Each part's rows of its own full output: (0, size)."""
    return [(0, size) for size in sizes]


def wrap_lora_layers(model: nn.Module, mapping: LoRAMapping, max_rank: int) -> dict[str, LinearWithLoRA]:
    """Replace every LoRA target of `model` by its LoRA-aware wrapper; engine name -> wrapper.
    Runs after the weights loaded (the loader reads the base layers by their own names) and
    before any kernel swap (a swapped base stays inside its wrapper)."""
    wrapped = {}
    for name, (parent, linear, attribute) in lora_targets(model).items():
        if isinstance(linear, RowParallelLinear):
            target = TargetModule(linear.in_features, (linear.weight.shape[0],))
            layer = RowParallelLinearWithLoRA(linear, mapping, max_rank, target, (linear.start, linear.end),
                                              [(0, linear.weight.shape[0])])
        elif isinstance(linear, QuantizedLinear):  # one rank only: its output is whole
            target = TargetModule(linear.in_features, tuple(linear.lora_part_sizes))
            layer = LinearWithLoRA(linear, mapping, max_rank, target, (0, linear.in_features),
                                   ranges(linear.lora_part_sizes))
        elif isinstance(linear, ColumnParallelLinear):
            target = TargetModule(linear.in_features, tuple(linear.full_sizes))
            layer = LinearWithLoRA(linear, mapping, max_rank, target, (0, linear.in_features),
                                   list(linear.output_ranges))
        else:
            target = TargetModule(linear.in_features, (linear.out_features,))
            layer = LinearWithLoRA(linear, mapping, max_rank, target, (0, linear.in_features),
                                   [(0, linear.out_features)])
        setattr(parent, attribute, layer)
        wrapped[name] = layer
    if not wrapped:
        raise ValueError(f"enable_lora: {type(model).__name__} has no linear LoRA applies to")
    return wrapped
