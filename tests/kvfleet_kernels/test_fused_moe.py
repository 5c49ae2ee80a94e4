"""The fused-MoE Triton kernel (TRITON_INTERPRET=1 on the CPU) against the torch path,
and the block alignment it runs on, row by row."""

from __future__ import annotations

import pytest
import torch

from kvfleet_kernels import reference
from kvfleet_kernels.fused_moe import fused_moe, moe_align_block_size


def test_align_groups_rows_by_expert_and_pads_each_group():
    topk_ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # rows 0..5 = token * 2 + choice
    sorted_row_ids, expert_ids = moe_align_block_size(topk_ids, block_m=4, num_experts=4)
    pad = 6
    # expert 0: rows 1, 4; expert 1: none (no block); expert 2: rows 0, 2, 5; expert 3: row 3
    assert sorted_row_ids.tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert expert_ids.tolist() == [0, 2, 3]


def moe_case(num_tokens, num_experts, top_k, hidden, intermediate, seed, used_experts=None, every_token=None):
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, device="cpu") * scale).to(torch.get_default_device())

    x = randn(num_tokens, hidden)
    w13, w2 = randn(num_experts, 2 * intermediate, hidden, scale=0.2), randn(num_experts, hidden, intermediate,
                                                                                 scale=0.2)
    pool = used_experts if used_experts is not None else list(range(num_experts))
    scores = randn(num_tokens, num_experts)
    blocked = torch.full((num_experts,), float("-inf"), device=scores.device)
    blocked[pool] = 0
    scores = scores + blocked
    if every_token is not None:
        scores[:, every_token] = 100.0  # chosen first by every token
    weights, ids = torch.topk(scores.softmax(-1), top_k)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("num_tokens, num_experts, top_k, hidden, intermediate", [
    (1, 4, 2, 64, 32), (7, 8, 2, 48, 40), (33, 8, 4, 64, 64), (70, 16, 2, 32, 96), (130, 4, 1, 64, 16)])
def test_kernel_matches_torch_path(num_tokens, num_experts, top_k, hidden, intermediate):
    args = moe_case(num_tokens, num_experts, top_k, hidden, intermediate, seed=num_tokens)
    torch.testing.assert_close(fused_moe(*args), reference.fused_moe(*args), rtol=1e-5, atol=1e-5)


def test_experts_with_no_tokens_and_one_every_token_chose():
    x, w13, w2, weights, ids = moe_case(40, 8, 2, 64, 32, seed=1, used_experts=[0, 3, 5], every_token=5)
    counts = torch.bincount(ids.flatten(), minlength=8).tolist()
    assert counts[5] == 40 and counts[1] == counts[2] == counts[4] == counts[6] == counts[7] == 0
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), reference.fused_moe(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_biases_and_gpt_oss_activation(activation):
    x, w13, w2, weights, ids = moe_case(25, 8, 2, 64, 32, seed=2)
    x = x * 4  # activations past the clamp limit
    generator = torch.Generator(device="cpu").manual_seed(3)
    w13_bias = torch.randn(8, 64, generator=generator, device="cpu").to(x.device)
    w2_bias = torch.randn(8, 64, generator=generator, device="cpu").to(x.device)
    options = {"swiglu_alpha": 1.702, "swiglu_limit": 1.0} if activation == "swigluoai" else {}
    got = fused_moe(x, w13, w2, weights, ids, activation, w13_bias, w2_bias, **options)
    expected = reference.fused_moe(x, w13, w2, weights, ids, activation, w13_bias, w2_bias, **options)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    plain = reference.fused_moe(x, w13, w2, weights, ids, activation, **options)
    assert (expected - plain).abs().max() > 0.1  # the biases mattered


def test_no_tokens():
    x, w13, w2, weights, ids = moe_case(3, 4, 2, 32, 16, seed=4)
    out = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert out.shape == (0, 32)
