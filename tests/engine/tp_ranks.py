"""Functions each rank of a 2-process gloo group runs in the tensor-parallel tests
(torch.multiprocessing.spawn needs them importable)."""

from __future__ import annotations

import torch
from torch import nn

from engine import parallel
from engine.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    merged_column_linear,
)


def load(param: nn.Parameter, full: torch.Tensor, part: int | None = None) -> None:
    param.weight_loader(param.data, full, part)


def parallel_layers_match_torch(rank: int, init_method: str) -> None:
    parallel.init_group(rank, 2, init_method, torch.device("cpu"))
    torch.manual_seed(0)  # the same full weights and inputs on both ranks
    x = torch.randn(5, 16)
    try:
        # Merged q/k/v with biases: each rank holds half the rows of each projection.
        q, k, v = nn.Linear(16, 8), nn.Linear(16, 4), nn.Linear(16, 4)
        qkv = merged_column_linear(16, [8, 4, 4], bias=True)
        for part, full in enumerate((q, k, v)):
            load(qkv.weight, full.weight.data, part)
            load(qkv.bias, full.bias.data, part)
        expected = torch.cat([q(x)[:, rank * 4:(rank + 1) * 4], k(x)[:, rank * 2:(rank + 1) * 2],
                              v(x)[:, rank * 2:(rank + 1) * 2]], dim=-1)
        torch.testing.assert_close(qkv(x), expected)

        # One KV head, two ranks: both hold it whole (replicated), and their own query half.
        kv_start, kv_end = parallel.kv_head_range(1)
        assert (kv_start, kv_end) == (0, 1)
        replicated = ColumnParallelLinear(16, [parallel.shard_range(8), (0, 4)], bias=False)
        load(replicated.weight, q.weight.data, 0)
        load(replicated.weight, k.weight.data, 1)
        torch.testing.assert_close(replicated(x), torch.cat([q(x)[:, rank * 4:(rank + 1) * 4], k(x)], dim=-1)
                                   - torch.cat([q.bias[rank * 4:(rank + 1) * 4], k.bias]))

        # Row-parallel with a bias: the halves' products summed by the all-reduce, the bias once.
        full = nn.Linear(16, 6)
        row = RowParallelLinear(16, 6, bias=True)
        load(row.weight, full.weight.data)
        row.bias.data.copy_(full.bias.data)
        torch.testing.assert_close(row(x[:, rank * 8:(rank + 1) * 8]), full(x))

        # An 11-row vocabulary over two ranks: 6 + 5 rows, the second shard padded.
        embedding = nn.Embedding(11, 4)
        shard = VocabParallelEmbedding(11, 4)
        load(shard.weight, embedding.weight.data)
        ids = torch.tensor([0, 5, 6, 10, 3, 6])
        torch.testing.assert_close(shard(ids), embedding(ids))

        # The LM head shares that layout (a tied head shares the very weight); logits on rank 0.
        head = ParallelLMHead(11, 4)
        head.weight = shard.weight
        hidden = torch.randn(3, 4)
        logits = head(hidden)
        if rank == 0:
            torch.testing.assert_close(logits, hidden @ embedding.weight.data.T)
        else:
            assert logits is None
    finally:
        parallel.destroy_group()
