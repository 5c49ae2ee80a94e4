"""The LoRA gather matmul: the Triton SGMV kernel (interpreter) against the torch reference,
and the CPU path of a LoRA-aware linear against the same reference, on segments of every
kind: the base model's (slot -1), empty ones, a slot no token uses, strided views."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.lora.layers import LinearWithLoRA, LoRAMapping, reference_delta
from engine.lora.peft import LoRAAdapter, TargetModule
from kernels import reference
from kernels.lora import sgmv

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


@pytest.mark.parametrize("use_triton", [False, True])
def test_lora_linear_delta_matches_the_reference(use_triton):
    torch.manual_seed(1)
    part_sizes, in_features = (32, 16, 16), 48
    mapping = LoRAMapping(4, torch.empty(0).device, torch.float32)  # the CPU, or CUDA under gpu_check
    base = nn.Linear(in_features, sum(part_sizes), bias=False)
    layer = LinearWithLoRA(base, mapping, 8, TargetModule(in_features, part_sizes), (0, in_features),
                           [(0, 32), (0, 16), (0, 16)])
    layer.set_slot(0, adapter("a", 8, {0: 32, 2: 16}, in_features), "layer")
    layer.set_slot(1, adapter("b", 4, {1: 16}, in_features), "layer")
    layer.set_slot(3, adapter("c", 2, {0: 32, 1: 16, 2: 16}, in_features), "layer")
    if use_triton:
        layer.use_triton_kernel()
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
        # (the CPU path pads the groups and runs one batched matmul each for shrink and expand).
        decode_slots = torch.tensor([0, 1, 3, -1, 1, 0, 3, 3, 1, -1, 0, 1])
        mapping.set(decode_slots, torch.ones(len(decode_slots), dtype=torch.int64))
        assert use_triton or mapping.groups.batched
        x = torch.randn(len(decode_slots), in_features)
        torch.testing.assert_close(layer(x), base(x) + reference_delta(x, layer), rtol=1e-4, atol=1e-4)
        assert use_triton or not mapping.groups.every_slot  # slot 2 is empty: the weights are selected
        mapping.set(torch.full((len(SEG_LENS),), -1), torch.tensor(SEG_LENS))  # no adapter this step
        x = torch.randn(num_rows, in_features)
        torch.testing.assert_close(layer(x), base(x))
