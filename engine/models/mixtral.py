"""Mixtral: Mistral's attention with a sparse MoE block in place of the MLP: each
token goes to the top 2 of 8 experts by a softmax over the router's logits, weighted
by the softmax renormalised over the two (engine/models/moe.py).

Checkpoints name the block `block_sparse_moe` and each expert's gate/up/down `w1`,
`w3`, `w2`; they land in the stacked experts of `mlp.experts`."""

from __future__ import annotations

import torch
from torch import nn

from engine.models.llama import LlamaDecoderLayer
from engine.models.mistral import MistralForCausalLM
from engine.models.moe import FusedMoE, TopKRouter, num_experts, per_expert_target


class SparseMoeBlock(nn.Module):
    """Router, then experts: `gate` and `experts`, the names Mixtral and Qwen3-MoE use."""

    def __init__(self, config, intermediate_size: int, renormalize: bool, fp32_weights: bool = False) -> None:
        super().__init__()
        self.gate = TopKRouter(config.hidden_size, num_experts(config), config.num_experts_per_tok,
                               "softmax_topk", renormalize, fp32_weights=fp32_weights)
        self.experts = FusedMoE(num_experts(config), config.hidden_size, intermediate_size, config.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> [T, H]"""
        topk_weights, topk_ids = self.gate(hidden)
        return self.experts(hidden, topk_weights, topk_ids)


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(config, config.intermediate_size, renormalize=True, fp32_weights=True)


class MixtralForCausalLM(MistralForCausalLM):
    layer_cls = MixtralDecoderLayer
    expert_projections = {"w1": "gate", "w3": "up", "w2": "down"}

    def remap_checkpoint_weight(self, name: str, tensor) -> list[tuple[str, object, object]] | None:
        """(parameter, tensor, part) for an expert's or the router's tensor; None for the rest."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        target = per_expert_target(name, self.expert_projections)
        if target is not None:
            return [(target[0], tensor, target[1])]
        if name.endswith(".mlp.gate.weight"):
            return [(name, tensor, None)]
        return None
