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
