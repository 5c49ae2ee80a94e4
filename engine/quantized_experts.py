"""An MoE layer's experts kept quantized (engine/quantized_linear.py's QuantizedExperts), computed as
kvfleet_kernels/reference_grouped.py's fused_moe defines them: each routed row through its expert's
gate_up, the gated activation and down, summed with its routing weight in expert order.

At decode every expert gets a few rows, and an expert at a time made 16 kernel calls a layer at 8
experts a token (each a fork and join of its own) plus their activations' rounding and the
activation. Where every expert's rows take the integer path (kvfleet_kernels/cpu_quantized_linear.py)
the layer runs as two grouped calls instead: every expert's gate_up, one activation over all rows,
every expert's down. The rows are those the per-expert path computes, bit for bit."""

from __future__ import annotations

import torch

from engine.quantized_linear import QuantizedExperts, integer_rows_below
from kvfleet_kernels import cpu_quantized_linear as kernels
from kvfleet_kernels import reference


def quantized_expert_linear(x: torch.Tensor, linear, bias: torch.Tensor | None) -> torch.Tensor:
    """One expert's matmul on its quantized weight (kvfleet_kernels/reference.py's fused_moe `linear`)."""
    out = linear(x)
    return out if bias is None else out + bias.to(out.dtype)


def quantized_fused_moe(experts: QuantizedExperts, hidden: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, activation: str, w13_bias: torch.Tensor | None,
                        w2_bias: torch.Tensor | None, **activation_args) -> torch.Tensor:
    """hidden [T, H], topk_* [T, k] -> [T, H]: reference.fused_moe over the quantized experts, as
    two grouped calls where every expert's rows take the integer path (and there are no biases)."""
    order, token_of_row, counts = reference.rows_by_expert(topk_ids, experts.num_experts)
    if not groupable(experts, int(counts.max()), w13_bias, w2_bias):
        return reference.fused_moe(hidden, experts.w13, experts.w2, topk_weights, topk_ids, activation, w13_bias,
                                   w2_bias, linear=quantized_expert_linear, **activation_args)
    rows = hidden[token_of_row]  # [T * k, H]
    routed = [expert for expert, count in enumerate(counts.tolist()) if count]
    offsets = [0, *torch.cumsum(counts[routed], 0).tolist()]
    dtype = torch.bfloat16 if hidden.dtype == torch.bfloat16 else torch.float32  # as QuantizedLinear's
    gate_up = hidden.new_empty((len(rows), experts.w13[0].out_features), dtype=dtype)
    kernels.linear_grouped(kernels.quantize_activations(rows), offsets, [experts.w13[e].parts for e in routed], gate_up)
    activated = reference.gated_activation(gate_up, activation, **activation_args)
    out_rows = hidden.new_empty((len(rows), experts.w2[0].out_features), dtype=dtype)
    kernels.linear_grouped(kernels.quantize_activations(activated), offsets, [experts.w2[e].parts for e in routed],
                           out_rows)
    return reference.sum_expert_rows(hidden, out_rows, topk_weights, order, token_of_row)


def groupable(experts: QuantizedExperts, most_rows: int, w13_bias, w2_bias) -> bool:
    """The grouped calls serve this step: the CPU kernels, no biases (gpt-oss's), no reordered inputs
    (GPTQ desc_act), and no expert with rows enough for the AMX or dense path."""
    if experts.kernel != "cpu" or w13_bias is not None or w2_bias is not None or most_rows >= integer_rows_below():
        return False
    if experts.inputs_in_order is None:  # once: the weights do not change after the load
        experts.inputs_in_order = all(weight.input_order is None for linear in [*experts.w13, *experts.w2]
                                      for weight in linear.parts)
    return experts.inputs_in_order
