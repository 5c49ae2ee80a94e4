"""Linears on quantized weights for the CPU (csrc/quantized_linear_cpu.cpp): 4-, 6- or 8-bit codes
with an fp16 scale and offset per group of input features, computed as integer dot products
against activations quantized to int16 per 32 features (why not int8: the kernel's header). The weight is never dequantized as a
whole: a decode step reads 4, 6 or 8 bits a weight where a bf16 linear reads 16.

Every format kvfleet keeps quantized is written in this one form, w = a * code - b per (output
column, group): engine/quantized_weights.py converts GGUF's blocks (and AWQ's and GPTQ's
tensors) to it, exactly but for rounding a and b to fp16."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from kvfleet_kernels.cpu_paged_attention import load_error, require_built


@functools.cache
def available() -> bool:
    """The library builds here (any CPU: the dot products use avx512_vnni where present)."""
    return load_error() is None


@functools.cache
def native_dot() -> bool:
    """The integer dot products run on avx512_vnni here (not g++'s generic vectors)."""
    return available() and torch.ops.kvfleet_cpu.quantized_dot_native()


@functools.cache
def amx_available() -> bool:
    """`linear_amx` runs here: a CPU with amx_bf16 whose kernel grants the tiles."""
    return available() and torch.ops.kvfleet_cpu.quantized_amx_available()


@dataclass
class QuantizedWeight:
    """A weight [out_features, in_features] as codes and per-group fp16 scales, unpacked: the
    form the format converters write and the reference (`dequantize`) reads."""

    codes: torch.Tensor  # uint8 [N, K], each < 2 ** bits
    scale: torch.Tensor  # fp16 [N, K / group_size]: a
    offset: torch.Tensor  # fp16 [N, K / group_size]: b, so that w = a * code - b
    bits: int  # 4, 6 or 8
    # Column j of the codes is input feature input_order[j] (GPTQ's desc_act, sorted into whole
    # groups); None: in order. The caller feeds x[:, input_order].
    input_order: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]: the weight the codes stand for."""
        expand = functools.partial(torch.repeat_interleave, repeats=self.group_size, dim=1)
        stored = expand(self.scale.float()) * self.codes.float() - expand(self.offset.float())
        if self.input_order is None:
            return stored
        dense = torch.empty_like(stored)
        dense[:, self.input_order] = stored
        return dense


@dataclass
class PackedQuantizedWeight:
    """A QuantizedWeight packed once for the kernel (layout: csrc/quantized_linear_cpu.cpp)."""

    packed: torch.Tensor  # uint8, 16 output columns a panel
    scales: torch.Tensor  # fp16 [panels, K / group_size, 2, 16] (a, b), or [..., 1, 16] (a) with zero_point
    bits: int
    group_size: int
    out_features: int
    in_features: int
    input_order: torch.Tensor | None = None  # as QuantizedWeight's
    zero_point: int | None = None  # b = zero_point * a everywhere: only a is held

    @property
    def zero_point_arg(self) -> int:
        return -1 if self.zero_point is None else self.zero_point

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes


def implied_zero_point(weight: QuantizedWeight) -> int | None:
    """z where every offset is z times its scale exactly, z a power of two below 2^bits: symmetric
    formats (GGUF's Q4_0, Q5_0, Q8_0 and Q6_K; GPTQ's and compressed-tensors' symmetric codes) hold
    w = a (code - z), so the packed form keeps a alone (Q6_K: 8 bits a weight, not 10)."""
    scale, offset = weight.scale.float(), weight.offset.float()
    for zero_point in (2 ** power for power in range(weight.bits)):
        if torch.equal(scale * zero_point, offset):
            return zero_point
    return None


def pack_weight(weight: QuantizedWeight) -> PackedQuantizedWeight:
    require_built()
    zero_point = implied_zero_point(weight)
    packed, scales = torch.ops.kvfleet_cpu.pack_quantized_weight(
        weight.codes.contiguous(), weight.scale.contiguous(), weight.offset.contiguous(), weight.bits,
        -1 if zero_point is None else zero_point)
    return PackedQuantizedWeight(packed, scales, weight.bits, weight.group_size, *weight.shape, weight.input_order,
                                 zero_point)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K] -> (int16 [rows, K], fp32 [rows, K / 8]): what `linear` reads; one call serves
    every linear of the same input (the q, k and v parts of a merged projection)."""
    return torch.ops.kvfleet_cpu.quantize_activations(x)


def linear(activations: tuple[torch.Tensor, torch.Tensor], weight: PackedQuantizedWeight,
           bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out [rows, N] (bf16 or fp32, may be a column slice of a wider output) = x @ W^T + bias,
    x as `quantize_activations` left it; bias [N] fp32 or None."""
    return linear_parts(activations, [weight], bias, out)


def parts_arguments(weights: list[PackedQuantizedWeight]) -> tuple[list, ...]:
    """The kernels' per-part arguments of weights side by side (packed, scales, bits, group, zero
    point, out features): a caller that makes many calls on the same weights builds them once."""
    return ([w.packed for w in weights], [w.scales for w in weights], [w.bits for w in weights],
            [w.group_size for w in weights], [w.zero_point_arg for w in weights], [w.out_features for w in weights])


def linear_parts(activations: tuple[torch.Tensor, torch.Tensor], weights: list[PackedQuantizedWeight],
                 bias: torch.Tensor | None, out: torch.Tensor, arguments: tuple[list, ...] | None = None) -> torch.Tensor:
    """out [rows, sum of the weights' N] = x @ [W_0; W_1; ...]^T + bias, the weights' columns side by
    side, in one call (a merged projection's parts, each with its own bits and group); bias fp32 or
    None; arguments: parts_arguments(weights), if the caller keeps them."""
    xq, xmeta = activations
    torch.ops.kvfleet_cpu.quantized_linear_parts(out, xq, xmeta, *(arguments or parts_arguments(weights)), bias)
    return out


def linear_amx(x: torch.Tensor, weight: PackedQuantizedWeight, bias: torch.Tensor | None,
               out: torch.Tensor) -> torch.Tensor:
    """out [rows, N] (bf16 or fp32, may be a column slice) = x [rows, K] bf16 @ W^T + bias on AMX
    tiles, W dequantized a panel at a time to bf16 (csrc/quantized_linear_amx.cpp)."""
    return linear_amx_parts(x, [weight], bias, out)


def linear_amx_parts(x: torch.Tensor, weights: list[PackedQuantizedWeight], bias: torch.Tensor | None,
                     out: torch.Tensor, arguments: tuple[list, ...] | None = None) -> torch.Tensor:
    """linear_amx over the weights' columns side by side, in one call (a merged projection's parts,
    each with its own bits and group), as linear_parts is for the integer products."""
    torch.ops.kvfleet_cpu.quantized_linear_amx_parts(out, x, *(arguments or parts_arguments(weights)), bias)
    return out


def dequantize_rows(weight: PackedQuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight, fp32 [len(ids), K]: an embedding table's lookups, gathered from
    the panels (row n is column n % 16 of panel n // 16) without unpacking the rest."""
    num_features, group = weight.in_features, weight.group_size
    panel, column = ids // 16, ids % 16
    if weight.bits == 8:  # [panels, K / 4 steps, 16 columns, 4] -> [ids, K]
        codes = weight.packed.view(-1, num_features // 4, 16, 4)[panel, :, column].reshape(len(ids), num_features)
    elif weight.bits == 6:  # [panels, K / 16 blocks, 3 vectors, 16 columns, 4]: two of nibble pairs, the top bits
        block = weight.packed.view(-1, num_features // 16, 3, 16, 4)[panel, :, :, column]  # [ids, K / 16, 3, 4]
        low = torch.stack((block[:, :, 0] & 0x0F, block[:, :, 0] >> 4, block[:, :, 1] & 0x0F, block[:, :, 1] >> 4), 2)
        top = torch.stack([(block[:, :, 2] >> (2 * q)) & 3 for q in range(4)], 2)  # [ids, K / 16, 4 steps, 4]
        codes = (low | (top << 4)).reshape(len(ids), num_features)
    else:  # [panels, K / 8 step pairs, 16 columns, 4]: low nibbles step 2j, high nibbles step 2j + 1
        both = weight.packed.view(-1, num_features // 8, 16, 4)[panel, :, column]  # [ids, K / 8, 4]
        codes = torch.stack((both & 0x0F, both >> 4), dim=2).reshape(len(ids), num_features)
    planes = 2 if weight.zero_point is None else 1
    scales = weight.scales.view(-1, num_features // group, planes, 16)[panel, :, :, column].float()  # [ids, groups, planes]
    scale = scales[..., 0].repeat_interleave(group, dim=1)
    offset = scale * weight.zero_point if weight.zero_point is not None else scales[..., 1].repeat_interleave(group, dim=1)
    return scale * codes.float() - offset


def linear_grouped(activations: tuple[torch.Tensor, torch.Tensor], row_offsets: list[int],
                   weights: list[list[PackedQuantizedWeight]], out: torch.Tensor) -> torch.Tensor:
    """out [M, N]: rows [row_offsets[g], row_offsets[g + 1]) of x times weights[g] (its parts side by
    side in N, as linear_parts), every group in one call: an MoE layer's experts over the rows routed
    to each. x as `quantize_activations` left it; no bias."""
    xq, xmeta = activations
    flat = [weight for parts in weights for weight in parts]
    torch.ops.kvfleet_cpu.quantized_linear_grouped(out, xq, xmeta, row_offsets, *parts_arguments(flat))
    return out


def column_chunks(weight: PackedQuantizedWeight, max_columns: int) -> list[PackedQuantizedWeight]:
    """The weight as consecutive slices of at most max_columns output features (a multiple of 16),
    each a view of its panels: a weight dequantized a slice at a time."""
    panels = -(-weight.out_features // 16)
    packed, scales = weight.packed.view(panels, -1), weight.scales.view(panels, -1)
    step = max(1, max_columns // 16)
    return [dataclasses.replace(weight, packed=packed[first:first + step].reshape(-1),
                                scales=scales[first:first + step].reshape((-1, *weight.scales.shape[1:])),
                                out_features=min(weight.out_features, 16 * (first + step)) - 16 * first)
            for first in range(0, panels, step)]


def dequantize_weight(weight: PackedQuantizedWeight, out: torch.Tensor) -> torch.Tensor:
    """The whole weight into out [N, K] (bf16 or fp32, contiguous): for steps of many rows
    (engine/quantized_linear.py), where a dense matmul outruns the integer dot products."""
    torch.ops.kvfleet_cpu.dequantize_quantized_weight(out, weight.packed, weight.scales, weight.bits, weight.group_size,
                                                      weight.zero_point_arg)
    return out
