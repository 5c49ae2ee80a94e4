"""Torch references of the grouped matmuls (re-exported by kvfleet_kernels/reference.py): a
mixture-of-experts layer's expert sum, the torch path and the oracle of
kvfleet_kernels/fused_moe.py, and the LoRA segmented gather matmul, the oracle of
kvfleet_kernels/lora.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# -- mixture of experts -------------------------------------------------------------

def gated_activation(gate_up: torch.Tensor, activation: str, swiglu_alpha: float = 1.702,
                     swiglu_limit: float = 7.0) -> torch.Tensor:
    """gate_up [N, 2 * I], the gate's features then the up projection's -> [N, I].

    silu:      silu(gate) * up (SwiGLU: Mixtral, Qwen3-MoE)
    swigluoai: gpt-oss's variant: gate clamped from above and up on both sides at
               swiglu_limit, gate * sigmoid(alpha * gate) * (up + 1)
    """
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "swigluoai":
        gate, up = gate.clamp(max=swiglu_limit), up.clamp(min=-swiglu_limit, max=swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * swiglu_alpha))
    raise ValueError(f"MoE activation {activation!r} is not supported; supported: silu, swigluoai")


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, linear=F.linear, **activation_args) -> torch.Tensor:
    """The expert sum of a mixture-of-experts layer: the torch path, and the oracle of
    kvfleet_kernels/fused_moe.py.

    hidden:       [T, H]
    w13:          [E, 2 * I, H] (each expert's gate rows, then its up rows); w13_bias [E, 2 * I]
    w2:           [E, H, I]; w2_bias [E, H]
    topk_weights: [T, k] float; topk_ids: [T, k] int
    returns       [T, H]: sum over j of topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])

    Rows sorted by expert, two matmuls per expert (a loop over experts, never tokens), added
    in expert order as transformers adds them; `linear(x, weight, bias)` runs each matmul
    (w13 and w2 may be lists of what it takes, e.g. oneDNN-packed weights)."""
    order, token_of_row, counts = rows_by_expert(topk_ids, len(w13))
    rows = hidden[token_of_row]  # [T * k, H]
    out_rows = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        part = slice(start, start + count)
        gate_up = linear(rows[part], w13[expert], None if w13_bias is None else w13_bias[expert])
        out_rows[part] = linear(gated_activation(gate_up, activation, **activation_args), w2[expert],
                                None if w2_bias is None else w2_bias[expert])
        start += count
    return sum_expert_rows(hidden, out_rows, topk_weights, order, token_of_row)


def rows_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (order [T * k]: the routed rows grouped by expert, token order within;
    token_of_row [T * k]: each sorted row's token; counts [num_experts]: rows an expert)."""
    flat_ids = topk_ids.flatten()  # [T * k], row t * k + j
    order = torch.argsort(flat_ids, stable=True)
    return order, order // topk_ids.shape[1], torch.bincount(flat_ids, minlength=num_experts)


def sum_expert_rows(hidden: torch.Tensor, out_rows: torch.Tensor, topk_weights: torch.Tensor, order: torch.Tensor,
                    token_of_row: torch.Tensor) -> torch.Tensor:
    """[T, H]: each token's expert outputs (out_rows, sorted as rows_by_expert left them) weighted by
    its routing weights and added in expert order."""
    weighted = (out_rows * topk_weights.flatten()[order, None]).to(hidden.dtype)
    return torch.zeros_like(hidden).index_add_(0, token_of_row, weighted)


# -- LoRA ------------------------------------------------------------------------------

def sgmv(x: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, seg_starts: torch.Tensor,
         seg_slots: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """Segmented gather matmul (punica's SGMV: the LoRA shrink and expand): segment i's rows of
    x [T, K] times weights[seg_slots[i]] [N, K].T into out [T, N]; slot -1 leaves its rows be."""
    bounds = seg_starts.tolist()
    for index, slot in enumerate(seg_slots.tolist()):
        rows = slice(bounds[index], bounds[index + 1])
        if slot >= 0:
            product = (x[rows].float() @ weights[slot].float().T).to(out.dtype)  # [rows, N]
            out[rows] = out[rows] + product if accumulate else product
    return out
