"""Building blocks shared by the model definitions."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels import reference


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernel = reference.rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.kernel(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """cos/sin table over every position, computed as transformers does (fp32
    frequencies, RoPE scaling types through its own ROPE_INIT_FUNCTIONS)."""

    STATIC_TYPES = ("default", "linear", "llama3", "yarn")

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        params = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", "default")
        if rope_type not in self.STATIC_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {self.STATIC_TYPES}")
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)  # [max_positions, head_dim]
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        self.kernel = reference.rotary

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        """positions [T]; query [T, Hq, D]; key [T, Hkv, D]"""
        cos = self.cos[positions].to(query.dtype)  # [T, D]
        sin = self.sin[positions].to(query.dtype)
        return self.kernel(query, key, cos, sin)


def use_triton_layers(model: nn.Module) -> None:
    """Route RMSNorm and rotary through the Triton kernels (the attention backend is
    chosen separately)."""
    from kernels.rms_norm import rms_norm  # noqa: PLC0415 (imports triton)
    from kernels.rotary import rotary

    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = rms_norm
        elif isinstance(module, RotaryEmbedding):
            module.kernel = rotary


class OneDNNLinear(nn.Module):
    """nn.Linear with its weight reordered once into oneDNN's blocked layout (CPU, fp32).

    Why: a plain CPU linear repacks the weight on every call; at decode batch sizes
    (tens of rows) that repacking costs as much as the product itself. Measured here
    at 64 rows: the 32k-vocabulary LM head 21.8 -> 10.4 ms, an MLP up-projection
    1.8 -> 0.85 ms. The same ops back torch.compile's CPU weight freezing.

    NOTE: oneDNN keeps state for every row count it is given, and prefill chunks come
    in arbitrary sizes: fed as they came, a worker grew ~2 KiB a request without end
    (benchmarks/soak.py: 611 -> 705 MiB over 24k requests, still rising; capping
    ONEDNN_PRIMITIVE_CACHE_CAPACITY or LRU_CACHE_CAPACITY did not stop it). Rows are
    padded up to `bucket_rows`, so at most 120 row counts up to 8192 ever reach it;
    the same worker then stayed at ~518 MiB.
    """

    def __init__(self, linear: nn.Linear, batch_size_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # [out_features, in_features] in an opaque blocked order, only readable by _linear_pointwise
        self.register_buffer("packed_weight",
                             torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_size_hint))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] -> [num_tokens, out_features]"""
        num_rows = x.shape[0]
        padded = bucket_rows(num_rows)
        if padded != num_rows:  # few distinct shapes reach oneDNN, which keeps state per shape
            x = torch.nn.functional.pad(x, (0, 0, 0, padded - num_rows))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")[:num_rows]


def bucket_rows(num_rows: int) -> int:
    """Exact up to 64 rows (decode batches); above, rounded up to 8 steps per doubling."""
    if num_rows <= 64:
        return num_rows
    step = 1 << (num_rows.bit_length() - 4)
    return -(-num_rows // step) * step


def can_use_onednn_linear(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available() \
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def use_onednn_linears(model: nn.Module, batch_size_hint: int) -> None:
    """Swap every nn.Linear of `model` for a OneDNNLinear. A weight tied to an embedding
    stays where it is (the embedding still reads it)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, OneDNNLinear(child, batch_size_hint))
