"""The LoRA gather matmul: the Triton SGMV kernel (interpreter) against the torch reference,
and the CPU paths of a LoRA-aware linear (grouped torch matmuls, the native BGMV kernel)
against the same reference, on segments of every kind: the base model's (slot -1), empty
ones, a slot no token uses, strided views, shapes off the vector width."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.lora.layers import LinearWithLoRA, LoRAMapping, reference_delta
from engine.lora.peft import LoRAAdapter, TargetModule
from kvfleet_kernels import reference
from kvfleet_kernels.cpu_layers import add_lora
from kvfleet_kernels.lora import sgmv
from tests.kvfleet_kernels.native import native_cpu

# 7 segments over 4 slots: slot 2 has no tokens, slot -1 is the base model, two segments are empty.
SEG_LENS = [5, 0, 1, 17, 3, 0, 40]
SEG_SLOTS = [0, 3, -1, 1, 3, 0, 1]


def segments():
    lens = torch.tensor(SEG_LENS)
    starts = torch.zeros(len(lens) + 1, dtype=torch.int64)
    starts[1:] = lens.cumsum(0)
    return starts, torch.tensor(SEG_SLOTS), int(lens.sum())


@pytest.mark.parametrize(("n", "k"), [(24, 64), (8, 100), (200, 16)])
def test_sgmv_kernel_matches_the_reference(n, k):
    torch.manual_seed(0)
    starts, slots, num_rows = segments()
    x, weights = torch.randn(num_rows, k), torch.randn(4, n, k)
    expected = reference.sgmv(x, weights, torch.zeros(num_rows, n), starts, slots)
    out = sgmv(x, weights, torch.zeros(num_rows, n), starts, slots)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert out[5].abs().sum() == 0  # the base model's row is left as it was
    # expand: accumulate into a column slice of a wider output, from a column slice of the input
    base = torch.randn(num_rows, n + 10)
    wide_x = torch.randn(num_rows, k + 3)
    expected = reference.sgmv(wide_x[:, 3:], weights, base.clone()[:, 4:4 + n], starts, slots, accumulate=True)
    out = base.clone()
    sgmv(wide_x[:, 3:], weights, out[:, 4:4 + n], starts, slots, accumulate=True)
    torch.testing.assert_close(out[:, 4:4 + n], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, :4], base[:, :4])  # columns outside the slice untouched


def adapter(name: str, rank: int, parts: dict[int, int], in_features: int) -> LoRAAdapter:
    """Random A [r, in] and B [out_p, r] for the given parts (part -> output features)."""
    modules = {"layer": {p: (torch.randn(rank, in_features), torch.randn(out, rank)) for p, out in parts.items()}}
    return LoRAAdapter(name, "/nowhere", rank, modules)


@pytest.mark.parametrize("kernel", ["grouped", pytest.param("native", marks=native_cpu), "triton"])
def test_lora_linear_delta_matches_the_reference(kernel):
    torch.manual_seed(1)
    part_sizes, in_features = (32, 16, 16), 48
    mapping = LoRAMapping(4, torch.empty(0).device, torch.float32)  # the CPU, or CUDA under gpu_check
    base = nn.Linear(in_features, sum(part_sizes), bias=False)
    layer = LinearWithLoRA(base, mapping, 8, TargetModule(in_features, part_sizes), (0, in_features),
                           [(0, 32), (0, 16), (0, 16)])
    layer.set_slot(0, adapter("a", 8, {0: 32, 2: 16}, in_features), "layer")
    layer.set_slot(1, adapter("b", 4, {1: 16}, in_features), "layer")
    layer.set_slot(3, adapter("c", 2, {0: 32, 1: 16, 2: 16}, in_features), "layer")
    if kernel == "triton":
        layer.use_triton_kernel()
    elif kernel == "native":
        layer.use_cpu_kernel()
    _, slots, num_rows = segments()
    mapping.set(slots, torch.tensor(SEG_LENS))
    x = torch.randn(num_rows, in_features)
    with torch.inference_mode():
        expected = base(x) + reference_delta(x, layer)
        torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)
        # The delta by hand for one token of slot 0: A, then B, part by part.
        a, b = layer.lora_a[0], layer.lora_b[0]
        by_hand = torch.cat([x[0] @ a[p * 8:(p + 1) * 8].T @ b[o:o + n].T
                             for p, (o, n) in enumerate([(0, 32), (32, 16), (48, 16)])])
        torch.testing.assert_close(layer(x)[0], base(x)[0] + by_hand, rtol=1e-4, atol=1e-4)
        # Decode-shaped: one token per sequence, slots interleaved, some tokens on the base model
        # (the grouped path pads the groups and runs one batched matmul each for shrink and expand).
        decode_slots = torch.tensor([0, 1, 3, -1, 1, 0, 3, 3, 1, -1, 0, 1])
        mapping.set(decode_slots, torch.ones(len(decode_slots), dtype=torch.int64))
        assert kernel != "grouped" or mapping.groups.batched
        x = torch.randn(len(decode_slots), in_features)
        torch.testing.assert_close(layer(x), base(x) + reference_delta(x, layer), rtol=1e-4, atol=1e-4)
        assert kernel != "grouped" or not mapping.groups.every_slot  # slot 2 is empty: the weights are selected
        mapping.set(torch.full((len(SEG_LENS),), -1), torch.tensor(SEG_LENS))  # no adapter this step
        x = torch.randn(num_rows, in_features)
        torch.testing.assert_close(layer(x), base(x))


@native_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_lora_kernel_matches_the_reference(dtype):
    """Shapes off the 16-lane width and the 4-row shrink blocks (in 37, rank 6, parts of 21 and
    18 columns), out a column slice of a wider row, slot -1 and a slot no token uses; each
    output rounded once from fp32, so low precision sits within a rounding of the fp32 sum."""
    torch.manual_seed(2)
    num_slots, rank, in_features, part_sizes = 4, 6, 37, (21, 18)
    lora_a = torch.randn(num_slots, 2 * rank, in_features)
    lora_b = torch.randn(num_slots, sum(part_sizes), rank)
    token_slots = torch.tensor([0, -1, 3, 3, 1, -1, 0, 1, 1, 3, 0])  # slot 2: no token
    x = torch.randn(len(token_slots), in_features)
    wide = torch.randn(len(token_slots), sum(part_sizes) + 5)
    starts = torch.arange(len(token_slots) + 1)  # one token a segment: the reference's layout
    expected = wide[:, 2:2 + sum(part_sizes)].clone()
    shrunk = reference.sgmv(x, lora_a, torch.zeros(len(token_slots), 2 * rank), starts, token_slots)
    for part, (offset, size) in enumerate([(0, 21), (21, 18)]):
        reference.sgmv(shrunk[:, part * rank:(part + 1) * rank], lora_b[:, offset:offset + size],
                       expected[:, offset:offset + size], starts, token_slots, accumulate=True)
    out = wide.to(dtype)
    add_lora(out[:, 2:2 + sum(part_sizes)], x.to(dtype), lora_a.to(dtype),
             lora_b.to(dtype).transpose(1, 2).contiguous(), token_slots, [0, 21, 39])
    # fp32: summation order only; low precision: inputs rounded, then one rounding of the result
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 0.3, torch.float16: 0.05}[dtype]
    torch.testing.assert_close(out[:, 2:2 + sum(part_sizes)].float(), expected, rtol=0.02, atol=tolerance)
    torch.testing.assert_close(out[:, :2], wide[:, :2].to(dtype))  # columns outside the slice untouched
    torch.testing.assert_close(out[:, -3:], wide[:, -3:].to(dtype))
    base_rows = token_slots < 0
    torch.testing.assert_close(out[base_rows], wide[base_rows].to(dtype))  # the base model's rows unchanged


@native_cpu
def test_native_lora_kernel_refuses_bad_inputs():
    lora_a, lora_b_t = torch.zeros(2, 8, 16), torch.zeros(2, 8, 24)
    x, out = torch.zeros(3, 16), torch.zeros(3, 24)
    with pytest.raises(RuntimeError, match="outside"):
        add_lora(out, x, lora_a, lora_b_t, torch.tensor([0, 2, -1]), [0, 24])
    with pytest.raises(RuntimeError, match="part_offsets"):
        add_lora(out, x, lora_a, lora_b_t, torch.tensor([0, 1, -1]), [0, 12, 24])  # 2 parts need 16 shrink rows
    with pytest.raises(RuntimeError, match="share a dtype"):
        add_lora(out, x.bfloat16(), lora_a, lora_b_t, torch.tensor([0, 1, -1]), [0, 24])
