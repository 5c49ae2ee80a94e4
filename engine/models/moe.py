"""Mixture-of-experts layers: the router, the experts, and where checkpoint tensors go.

    hidden [T, H] --TopKRouter--> topk_ids [T, k], topk_weights [T, k]
                  --FusedMoE----> sum over the k chosen experts, each a gated MLP

The router is replicated on every rank. Under tensor parallelism each expert's
intermediate dimension is split (vLLM's default for MoE): a rank holds every expert's
slice of gate/up rows and down columns, and one all-reduce after the expert sum
finishes the layer, as for a dense MLP.

The experts of every model live in one stacked layout, whatever the checkpoint:
    w13_weight [E, 2 * I / N, H]   each expert's gate rows, then its up rows (this rank's)
    w2_weight  [E, H, I / N]
    w13_bias   [E, 2 * I / N], w2_bias [E, H] (gpt-oss)
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel
from engine.models.layers import onednn_linear, packed_bf16_kernel
from engine.models.parallel_layers import copy_checked, set_loader
from engine.quantized_experts import quantized_fused_moe
from engine.quantized_linear import QuantizedExperts
from kvfleet_kernels import cpu_linear, reference

# softmax_topk: softmax over all experts in fp32, then the top k (Mixtral, Qwen3-MoE);
#   renormalize: the k weights divided by their sum (Mixtral always; Qwen3-MoE by norm_topk_prob).
# topk_softmax: the top k logits, then a softmax over those k (gpt-oss).
SCORING = ("softmax_topk", "topk_softmax")


class TopKRouter(nn.Module):
    """Which k experts each token goes to, and with what weights, by one model's rule.
    Ties go where torch.topk puts them, as in transformers."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scoring: str, renormalize: bool,
                 bias: bool = False, fp32_weights: bool = False) -> None:
        super().__init__()
        if scoring not in SCORING:
            raise ValueError(f"router scoring {scoring!r}; supported: {SCORING}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, {num_experts}] (the number of experts)")
        self.top_k, self.scoring, self.renormalize = top_k, scoring, renormalize
        # softmax_topk's weights stay fp32 (Mixtral) or are cast to the model's dtype (Qwen3-MoE):
        # in bf16 the expert sum rounds differently, so each model keeps its own.
        self.fp32_weights = fp32_weights
        # A plain parameter, not nn.Linear: the CPU path's linear swap must not touch it, so
        # the logits are bit for bit transformers' and no near-tie flips an expert.
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))  # [E, H], replicated
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (topk_weights [T, k], topk_ids [T, k] int64)"""
        logits = F.linear(hidden, self.weight, self.bias)  # [T, E]
        if self.scoring == "topk_softmax":
            values, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(values, dim=-1), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.fp32_weights else weights.to(logits.dtype)), ids


class FusedMoE(nn.Module):
    """The experts of one layer, stacked; forward = the weighted sum of each token's k
    experts, all-reduced over the tensor-parallel group.

    `kernel` is the torch path (kvfleet_kernels/reference.py: per-expert matmuls over the rows
    sorted by expert) unless the model runner picks the Triton one (kvfleet_kernels/fused_moe.py)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str,
                 bias: bool = False, stacked_checkpoint: bool = False, **activation_args) -> None:
        super().__init__()
        if activation not in ("silu", "swigluoai"):
            raise ValueError(f"MoE activation {activation!r} is not supported; supported: silu, swigluoai")
        self.num_experts, self.activation, self.activation_args = num_experts, activation, activation_args
        self.start, self.end = parallel.shard_range(intermediate_size)  # this rank's intermediate features
        local = self.end - self.start
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, local))
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * local)) if bias else None
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        # One checkpoint tensor per expert and projection, or (gpt-oss: stacked) one for all experts.
        tensors_per_projection = 1 if stacked_checkpoint else num_experts
        for param in (self.w13_weight, self.w13_bias):
            if param is not None:
                set_loader(param, self._load_w13, 2 * tensors_per_projection)
        set_loader(self.w2_weight, self._load_w2, tensors_per_projection)
        if self.w2_bias is not None:
            set_loader(self.w2_bias, self._load_w2_bias, tensors_per_projection)
        self.kernel = reference.fused_moe
        self.packed: tuple[list, list] | None = None  # pack_for_onednn(): per expert, oneDNN's or PackedExpertWeight
        self.linear = onednn_linear  # what runs a packed expert's matmul
        self.quantized: QuantizedExperts | None = None  # keep_quantized(): the experts as the checkpoint holds them

    def keep_quantized(self, kernel: str) -> QuantizedExperts:
        """The experts kept quantized (engine/quantized_linear.py), computed on by `kernel`'s
        matmuls, in place of the stacked weights, which are dropped before any is read."""
        self.quantized = QuantizedExperts(self.num_experts, self.w13_weight.shape[-1], self.end - self.start, kernel)
        self.w13_weight = self.w2_weight = None
        return self.quantized

    def use_triton_kernel(self) -> None:
        from kvfleet_kernels.fused_moe import fused_moe  # noqa: PLC0415 (imports triton)

        self.kernel = fused_moe

    def pack_for_onednn(self, batch_size_hint: int) -> None:
        """CPU: each expert's w13 and w2 packed once, as dense layers are (engine/models/layers.py
        says why): a few rows per expert is the common case, where repacking on every call
        doubled the expert matmuls' time. bf16 experts go to the CPU's packed bf16 kernel
        (PackedBf16Linear's), the rest to oneDNN's blocked layout. The stacked weights are
        dropped: the packed copies replace them. Experts kept quantized are packed already."""
        if self.quantized is not None:
            return
        kernels = {packed_bf16_kernel(self.w13_weight), packed_bf16_kernel(self.w2_weight)}
        kernel = kernels.pop() if len(kernels) == 1 else None

        def pack(weight: torch.Tensor):  # one expert's [out, in]
            if kernel is None:
                return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)
            return PackedExpertWeight(cpu_linear.pack_weight(weight, kernel), weight.shape[0], kernel)

        self.linear = onednn_linear if kernel is None else packed_expert_linear
        if kernel is not None:  # the kernel adds an fp32 bias: widened once here, as PackedBf16Linear's is
            for bias in (self.w13_bias, self.w2_bias):
                if bias is not None:
                    bias.data = bias.data.float()
        self.packed = ([pack(w) for w in self.w13_weight], [pack(w) for w in self.w2_weight])
        self.w13_weight = self.w2_weight = None

    def _load_w13(self, param: torch.Tensor, source, part: tuple[int | None, str]) -> None:
        """source: one expert's gate or up weight [I, H] (bias [I]), or every expert's
        [E, I, H] (bias [E, I]) when part's expert is None; this rank's rows go in."""
        expert, projection = part
        local = self.end - self.start
        offset = 0 if projection == "gate" else local
        if expert is None:
            copy_checked(param[:, offset:offset + local], source[:, self.start:self.end])
        else:
            copy_checked(param[expert, offset:offset + local], source[self.start:self.end])

    def _load_w2(self, param: torch.Tensor, source, part: tuple[int | None, str]) -> None:
        """source: one expert's down weight [H, I], or every expert's [E, H, I]."""
        expert, _ = part
        if expert is None:
            copy_checked(param, source[:, :, self.start:self.end])
        else:
            copy_checked(param[expert], source[:, self.start:self.end])

    def _load_w2_bias(self, param: torch.Tensor, source, part: tuple[int | None, str]) -> None:
        expert, _ = part
        copy_checked(param if expert is None else param[expert], source[:])

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], topk_* [T, k] -> [T, H]"""
        # The down bias belongs to the whole sum: rank 0 adds it, the all-reduce spreads it.
        w2_bias = self.w2_bias if parallel.tp_rank() == 0 else None
        if self.quantized is not None:
            out = quantized_fused_moe(self.quantized, hidden, topk_weights, topk_ids, self.activation, self.w13_bias,
                                      w2_bias, **self.activation_args)
        elif self.packed is not None:
            out = reference.fused_moe(hidden, *self.packed, topk_weights, topk_ids, self.activation, self.w13_bias,
                                      w2_bias, linear=self.linear, **self.activation_args)
        else:
            out = self.kernel(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation,
                              self.w13_bias, w2_bias, **self.activation_args)
        return parallel.all_reduce(out)


class PackedExpertWeight(NamedTuple):
    """One expert's weight [out, in] packed for a bf16 kernel of kvfleet_kernels/cpu_linear.py."""
    packed: torch.Tensor  # [ceil(out / 64), in * 64] VNNI panels
    out_features: int
    kernel: str


def packed_expert_linear(x: torch.Tensor, weight: PackedExpertWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ one packed expert's weight^T + bias (fp32: pack_for_onednn widened it) -> [rows, out] bf16
    (reference.fused_moe's `linear`)."""
    return cpu_linear.linear(x, weight.packed, weight.out_features, bias, weight.kernel)


# experts.<e>.<projection>.weight: one expert's tensor, in Mixtral's and Qwen's checkpoints.
PER_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<projection>\w+)\.weight$")


def per_expert_target(name: str, projections: dict[str, str]) -> tuple[str, tuple[int, str]] | None:
    """A per-expert checkpoint name -> (the FusedMoE parameter, (expert, gate|up|down)),
    or None for any other name. `projections`: checkpoint name -> role, e.g. Mixtral's
    {"w1": "gate", "w3": "up", "w2": "down"}."""
    match = PER_EXPERT_NAME.match(name)
    if match is None or match["projection"] not in projections:
        return None
    role = projections[match["projection"]]
    param = "w2_weight" if role == "down" else "w13_weight"
    return f"{match['prefix']}.{param}", (int(match["expert"]), role)


def active_parameter_fraction(hf_config) -> float:
    """top_k / num_experts: the share of a layer's expert weights one token reads."""
    return hf_config.num_experts_per_tok / num_experts(hf_config)


def num_experts(hf_config) -> int:
    return getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 0
