"""Tensor-parallel layers (Megatron's split, as nano-vllm and vLLM do it).

    column-parallel linear   output features split: no communication; merged projections
                             (q/k/v, gate/up) each keep their own slice
    row-parallel linear      input features split: all-reduce, then the bias, once
    vocab-parallel embedding rows of the vocabulary split: look up the own rows, zero the
                             rest, all-reduce
    parallel LM head         the embedding's layout (a tied head shares its weight);
                             logits gathered to rank 0

Each parameter carries a `weight_loader(param, source, part)` that copies only this
rank's slice of a safetensors slice (`safe_open(...).get_slice(name)`), so a rank reads
and holds ~1/N of the weights. With a group of one the factories return plain torch
layers, exactly what the models used before tensor parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel
from kvfleet_kernels import cdiv


def set_loader(param: nn.Parameter, loader, num_parts: int = 1) -> None:
    param.weight_loader = loader  # read by engine.loader
    param.num_parts = num_parts  # checkpoint tensors that fill it (merged projections: several)


class ColumnParallelLinear(nn.Linear):
    """One matmul for one or more projections of the same input. `output_ranges[i]` is
    the [start, end) of projection i's output rows this rank holds; the rows sit one
    projection after the other. A plain nn.Linear (on one rank, the whole projections)."""

    def __init__(self, in_features: int, output_ranges: list[tuple[int, int]], bias: bool,
                 full_sizes: list[int] | None = None) -> None:
        self.output_ranges = output_ranges
        self.sizes = [end - start for start, end in output_ranges]
        self.full_sizes = full_sizes or self.sizes  # each projection's whole output (what a LoRA B covers)
        super().__init__(in_features, sum(self.sizes), bias=bias)
        for param in self.parameters():
            set_loader(param, self._load, len(output_ranges))

    def _load(self, param: torch.Tensor, source, part: int | None) -> None:
        part = part or 0
        start, end = self.output_ranges[part]
        destination = param.narrow(0, sum(self.sizes[:part]), self.sizes[part])
        copy_checked(destination, source[start:end])


def merged_column_linear(in_features: int, full_sizes: list[int], bias: bool) -> ColumnParallelLinear:
    """Projections of `full_sizes` output features each, split evenly over the group."""
    return ColumnParallelLinear(in_features, [parallel.shard_range(size) for size in full_sizes], bias, full_sizes)


class RowParallelLinear(nn.Module):
    """Input features split over the ranks; the partial products are summed with an
    all-reduce and the bias is added once, after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features  # the whole input; this rank multiplies columns [start, end)
        self.start, self.end = parallel.shard_range(in_features)
        self.weight = nn.Parameter(torch.empty(out_features, self.end - self.start))  # [out, in / N]
        set_loader(self.weight, lambda param, source, _: copy_checked(param, source[:, self.start:self.end]))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in / N] -> [T, out]"""
        out = parallel.all_reduce(F.linear(x, self.weight))
        return out + self.bias if self.bias is not None else out


def row_parallel_linear(in_features: int, out_features: int, bias: bool) -> nn.Module:
    if parallel.tp_size() == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the table on this rank; the last rank's shard is padded with
    zero rows when N does not divide the vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        local = cdiv(num_embeddings, parallel.tp_size())
        self.start = parallel.tp_rank() * local
        self.end = min(num_embeddings, self.start + local)
        self.weight = nn.Parameter(torch.zeros(local, embedding_dim))  # [V / N (padded), dim]
        set_loader(self.weight, self._load)

    def _load(self, param: torch.Tensor, source, _part) -> None:
        copy_checked(param[: self.end - self.start], source[self.start:self.end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, dim]"""
        owned = (ids >= self.start) & (ids < self.end)
        local_ids = torch.where(owned, ids - self.start, 0)
        out = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return parallel.all_reduce(out)


def vocab_embedding(num_embeddings: int, embedding_dim: int) -> nn.Module:
    if parallel.tp_size() == 1:
        return nn.Embedding(num_embeddings, embedding_dim)
    return VocabParallelEmbedding(num_embeddings, embedding_dim)


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head over this rank's vocabulary rows; logits gathered to rank 0 (the only
    rank that samples); the other ranks get None."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, dim] -> logits [N, vocab] on rank 0"""
        local = F.linear(hidden, self.weight)  # [N, V / N]
        if parallel.tp_rank() == 0:
            parts = [torch.empty_like(local) for _ in range(parallel.tp_size())]
            torch.distributed.gather(local, parts, dst=0)
            return torch.cat(parts, dim=-1)[:, : self.num_embeddings]
        torch.distributed.gather(local, None, dst=0)
        return None


def lm_head(hidden_size: int, vocab_size: int) -> nn.Module:
    if parallel.tp_size() == 1:
        return nn.Linear(hidden_size, vocab_size, bias=False)
    return ParallelLMHead(vocab_size, hidden_size)


def copy_checked(destination: torch.Tensor, source) -> None:
    """Copy a checkpoint slice (a safetensors slice, read now) into a parameter's slice."""
    tensor = source
    if tuple(destination.shape) != tuple(tensor.shape):
        raise ValueError(f"shape {tuple(tensor.shape)}, the model expects {tuple(destination.shape)}")
    destination.copy_(tensor)
