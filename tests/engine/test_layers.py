"""Shared layers against their torch.nn counterparts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.models.layers import OneDNNLinear, bucket_rows, can_use_onednn_linear


def test_row_buckets_keep_decode_sizes_and_bound_the_shapes():
    assert [bucket_rows(n) for n in (1, 7, 64)] == [1, 7, 64]
    assert [bucket_rows(n) for n in (65, 72, 73, 129, 1000, 8192)] == [72, 72, 80, 144, 1024, 8192]
    sizes = range(1, 8193)
    assert all(n <= bucket_rows(n) <= n * 1.125 for n in sizes)  # at most 12.5% padding
    assert len({bucket_rows(n) for n in sizes}) == 64 + 7 * 8  # what oneDNN sees: 120 shapes, not 8192


@pytest.mark.skipif(not can_use_onednn_linear(torch.device("cpu"), torch.float32), reason="needs oneDNN")
@pytest.mark.parametrize("num_rows", [1, 33, 64, 65, 100, 513])
def test_onednn_linear_equals_nn_linear_for_any_row_count(num_rows):
    torch.manual_seed(0)
    linear = nn.Linear(48, 40)
    x = torch.randn(num_rows, 48)
    got = OneDNNLinear(linear, batch_size_hint=64)(x)
    assert got.shape == (num_rows, 40)
    torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)


def bf16_kernels() -> list[str]:
    """The packed bf16 linear kernels this CPU runs (builds the native library)."""
    from kvfleet_kernels import cpu_linear  # noqa: PLC0415

    return [kernel for kernel in cpu_linear.KERNELS if cpu_linear.available(kernel)]


def each_bf16_kernel(test):
    """Runs `test` once per kernel in cpu_linear.KERNELS, skipping those this CPU lacks."""
    from kvfleet_kernels import cpu_linear  # noqa: PLC0415

    marks = {kernel: pytest.mark.skipif(kernel not in bf16_kernels(), reason=f"no {kernel} bf16 linears on this CPU")
             for kernel in cpu_linear.KERNELS}
    return pytest.mark.parametrize("kernel", [pytest.param(k, marks=marks[k]) for k in cpu_linear.KERNELS])(test)


@each_bf16_kernel
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 64, 64), (5, 20, 2), (8, 130, 64), (17, 100, 576),
                                                             (64, 960, 576), (300, 3072, 576), (513, 70, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_linear_rounds_the_fp32_product_to_bf16(kernel, rows, out_features, in_features, with_bias):
    """Row counts across the tiles of rows and the blocks of them, widths off the 64-column
    panels: fp32 sums of exact bf16 products, rounded once to bf16 (with the bias added in fp32
    first), as a bf16 matmul's are. Only the order of the fp32 sums differs from torch's, so an
    output sitting on a rounding boundary may land one bf16 ulp away: nearly all must be equal."""
    from engine.models.layers import PackedBf16Linear  # noqa: PLC0415

    generator = torch.Generator().manual_seed(rows * out_features)
    linear = nn.Linear(in_features, out_features, bias=with_bias).bfloat16()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator))
        if with_bias:
            linear.bias.copy_(torch.randn(out_features, generator=generator))
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    expected = x.float() @ linear.weight.float().t()
    expected = (expected + linear.bias.float() if with_bias else expected).bfloat16()
    packed = PackedBf16Linear(linear, kernel)
    got = packed(x)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-3)
    assert (got == expected).float().mean() > 0.999
    strided = torch.cat([x, x], dim=1)[:, :in_features]  # rows 2 * in_features apart, read in place
    assert torch.equal(packed(strided), got)
    assert torch.equal(packed(x.float()), got)  # other dtypes are cast to bf16 first


@each_bf16_kernel
def test_packed_bf16_linear_refuses_what_it_cannot_lay_out(kernel):
    from kvfleet_kernels import cpu_linear  # noqa: PLC0415

    with pytest.raises(RuntimeError, match="K must be even"):
        cpu_linear.pack_weight(torch.ones(64, 7), kernel)
    packed = cpu_linear.pack_weight(torch.ones(64, 8), kernel)
    with pytest.raises(RuntimeError, match=f"packed must come from pack_{kernel}_weight for x's K"):
        cpu_linear.linear(torch.ones(2, 16, dtype=torch.bfloat16), packed, 64, None, kernel)
    with pytest.raises(RuntimeError, match="N the packed weight's"):
        cpu_linear.linear(torch.ones(2, 8, dtype=torch.bfloat16), packed, 65, None, kernel)


def test_vnni_panels_hold_column_pairs_side_by_side():
    """The vnni layout, element by element: panel b, pair p, column c holds W[64b + c, 2p] then
    W[64b + c, 2p + 1]; columns past N are zeros."""
    if "vnni" not in bf16_kernels():
        pytest.skip("no vnni bf16 linears on this CPU")
    from kvfleet_kernels import cpu_linear  # noqa: PLC0415

    weight = torch.arange(70 * 6, dtype=torch.float32).reshape(70, 6).bfloat16()
    packed = cpu_linear.pack_weight(weight, "vnni").view(2, 3, 64, 2)  # [panels, K/2, 64, 2]
    assert torch.equal(packed[1, 2, 5], weight[69, 4:6])
    assert torch.equal(packed[0, 0, 0], weight[0, 0:2])
    assert not packed[1, :, 6:].any()


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 64, 576), (3, 130, 64), (7, 40, 96), (200, 70, 32)])
def test_vnni_results_do_not_depend_on_the_thread_count(rows, out_features, in_features):
    """With fewer (row block, panel) items than threads the vnni kernel splits each panel into
    slices of 2 or 1 vectors (a narrow layer at decode sizes on a many-core CPU). Every column's
    sum runs in the same order whichever thread takes it: the output is bit for bit the
    one-thread output, slices wholly in a panel's padding included."""
    if "vnni" not in bf16_kernels():
        pytest.skip("no vnni bf16 linears on this CPU")
    from kvfleet_kernels import cpu_linear  # noqa: PLC0415

    generator = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    packed = cpu_linear.pack_weight(weight, "vnni")
    threads = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 2, 3, 8):  # slices of 4, 2 and 1 vectors
            torch.set_num_threads(count)
            outputs.append(cpu_linear.linear(x, packed, out_features, bias, "vnni"))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])
    expected = (x.float() @ weight.float().t() + bias).bfloat16()
    torch.testing.assert_close(outputs[0], expected, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("kernel", [None, "brgemm", "vnni"])
def test_bf16_linears_take_the_preferred_kernel(monkeypatch, kernel):
    """bf16 weights with an even in_features go to PackedBf16Linear on the CPU's preferred
    kernel (brgemm on AMX, vnni on avx512_bf16), everything else to OneDNNLinear; fp32 models
    always to OneDNNLinear."""
    from engine.models import layers  # noqa: PLC0415
    from kvfleet_kernels import cpu_linear  # noqa: PLC0415

    if not can_use_onednn_linear(torch.device("cpu"), torch.bfloat16) or (kernel and kernel not in bf16_kernels()):
        pytest.skip(f"needs oneDNN's bf16 matmul and the {kernel} kernel")
    monkeypatch.setattr(cpu_linear, "preferred_kernel", lambda: kernel)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 7), nn.Linear(7, 5)).bfloat16()
    layers.use_onednn_linears(model, batch_size_hint=8)
    packed = "PackedBf16Linear" if kernel else "OneDNNLinear"
    assert [type(m).__name__ for m in model] == [packed, packed, "OneDNNLinear"]  # 7 inputs: no bf16 pairs
    assert [getattr(m, "kernel", None) for m in model[:2]] == [kernel, kernel]
    fp32 = nn.Sequential(nn.Linear(64, 32))
    layers.use_onednn_linears(fp32, batch_size_hint=8)
    assert type(fp32[0]).__name__ == "OneDNNLinear"


@each_bf16_kernel
@pytest.mark.parametrize("rows", [1, 5, 24, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gate_up_silu_is_the_linear_then_silu_and_mul_bit_for_bit(kernel, rows, with_bias):
    """The fused gate_up + SiLU-and-mul rounds gate and up to bf16 before the SiLU, as the two
    ops do: its output equals theirs exactly, over tiles of every row count and over several row
    blocks (128 rows a block on vnni, 256 on brgemm)."""
    from engine.models.layers import PackedBf16Linear  # noqa: PLC0415
    from kvfleet_kernels.cpu_layers import silu_and_mul  # noqa: PLC0415

    generator = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 2 * 192, bias=with_bias).bfloat16()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * 0.3)
        if with_bias:
            linear.bias.copy_(torch.randn(2 * 192, generator=generator))
    x = torch.randn(rows, 96, generator=generator).bfloat16()
    packed = PackedBf16Linear(linear, kernel)
    assert packed.can_fuse_silu_and_mul()
    fused = packed.forward_silu_and_mul(x)
    assert fused.shape == (rows, 192) and fused.dtype == torch.bfloat16
    assert torch.equal(fused, silu_and_mul(packed(x)))
    gate, up = (x.float() @ linear.weight.float().t() + (linear.bias.float() if with_bias else 0)).bfloat16().chunk(2, 1)
    torch.testing.assert_close(fused, (torch.nn.functional.silu(gate.float()).bfloat16() * up).bfloat16(), rtol=2**-6,
                               atol=1e-2)


def test_gate_up_silu_splits_narrow_layers_over_many_threads_with_the_same_bits():
    """With more threads than (row block, panel) items, vnni splits each panel into slices of 2
    or 1 vectors; each slice's gate and up pass still pair up, and the bits do not change."""
    if "vnni" not in bf16_kernels():
        pytest.skip("no vnni bf16 linears on this CPU")
    from kvfleet_kernels import cpu_linear  # noqa: PLC0415
    from kvfleet_kernels.cpu_layers import silu_and_mul  # noqa: PLC0415

    generator = torch.Generator().manual_seed(7)
    weight, x = torch.randn(2 * 64, 32, generator=generator), torch.randn(3, 32, generator=generator).bfloat16()
    packed = cpu_linear.pack_weight(weight, "vnni")
    threads = torch.get_num_threads()
    try:
        for count in (2, 4, 8):  # one gate panel: slices of 4, 2 and 1 vectors
            torch.set_num_threads(count)
            fused = cpu_linear.gate_up_silu(x, packed, 128, None, "vnni")
            assert torch.equal(fused, silu_and_mul(cpu_linear.linear(x, packed, 128, None, "vnni"))), count
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows, out_features, in_features", [(64, 576, 96), (3, 130, 64), (300, 960, 32)])
def test_brgemm_results_do_not_depend_on_the_thread_count(rows, out_features, in_features):
    """brgemm cuts each thread's share at 16-column slices, so that panels that do not divide
    among the threads (SmolLM2's 576 outputs: 9 panels) still split evenly: a thread then runs
    part of a panel. Every column's sum runs in the same order whichever call computes it: the
    linear and the fused gate_up are bit for bit their one-thread outputs, slices wholly in a
    panel's padding and several row blocks included."""
    if "brgemm" not in bf16_kernels():
        pytest.skip("no brgemm bf16 linears on this CPU")
    from kvfleet_kernels import cpu_linear  # noqa: PLC0415

    generator = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    packed = cpu_linear.pack_weight(weight, "brgemm")
    gate_up = cpu_linear.pack_weight(torch.randn(2 * 192, in_features, generator=generator).bfloat16(), "brgemm")
    threads = torch.get_num_threads()
    try:
        outputs, fused = [], []
        for count in (1, 2, 3, 8):  # shares of whole panels, and of 1 to 3 slices at their ends
            torch.set_num_threads(count)
            outputs.append(cpu_linear.linear(x, packed, out_features, bias, "brgemm"))
            fused.append(cpu_linear.gate_up_silu(x, gate_up, 2 * 192, None, "brgemm"))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])
    assert all(torch.equal(out, fused[0]) for out in fused[1:])
    expected = (x.float() @ weight.float().t() + bias).bfloat16()
    torch.testing.assert_close(outputs[0], expected, rtol=2**-7, atol=1e-3)


@each_bf16_kernel
def test_gate_up_silu_refuses_widths_off_the_panels(kernel):
    from kvfleet_kernels import cpu_linear  # noqa: PLC0415

    assert not cpu_linear.can_fuse_silu_and_mul(kernel, 2 * 100) and cpu_linear.can_fuse_silu_and_mul(kernel, 256)
    packed = cpu_linear.pack_weight(torch.ones(200, 8), kernel)
    with pytest.raises(RuntimeError, match="I a multiple of 64"):
        cpu_linear.gate_up_silu(torch.ones(2, 8, dtype=torch.bfloat16), packed, 200, None, kernel)


@each_bf16_kernel
def test_gated_mlps_fuse_only_silu_on_a_plain_packed_projection(kernel, monkeypatch):
    """With either bf16 kernel a Llama's SiLU MLPs take the fused path (and still match
    transformers: the parity tests), a GeGLU one does not, and a LoRA-wrapped gate_up keeps its
    adapters."""
    from kvfleet_kernels import cpu_linear  # noqa: PLC0415

    monkeypatch.setattr(cpu_linear, "preferred_kernel", lambda: kernel)
    from transformers import LlamaConfig  # noqa: PLC0415

    from engine.models.layers import fuse_gate_up_silu, use_cpu_layers, use_onednn_linears  # noqa: PLC0415
    from engine.models.llama import LlamaMLP  # noqa: PLC0415

    config = LlamaConfig(hidden_size=64, intermediate_size=128, hidden_act="silu")
    silu, gelu = LlamaMLP(config).bfloat16(), LlamaMLP(config, activation="gelu_pytorch_tanh").bfloat16()
    model = nn.ModuleList([silu, gelu])
    use_cpu_layers(model)
    x = torch.randn(5, 64).bfloat16()
    expected = silu(x)  # unfused: torch's linears, then the native silu_and_mul
    use_onednn_linears(model, batch_size_hint=8)
    assert silu.fused_gate_up_act is not None and gelu.fused_gate_up_act is None
    assert torch.equal(silu(x), silu.down_proj(silu.act_and_mul(silu.gate_up_proj(x))))
    torch.testing.assert_close(silu(x), expected, rtol=2**-6, atol=1e-2)
    wrapped = LlamaMLP(config).bfloat16()
    use_cpu_layers(wrapped)
    wrapped.gate_up_proj = nn.Sequential(wrapped.gate_up_proj)  # stands for LinearWithLoRA around it
    fuse_gate_up_silu(wrapped)
    assert wrapped.fused_gate_up_act is None
