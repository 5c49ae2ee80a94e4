"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (q/k norms) with a sparse
MoE block on the layers `decoder_sparse_step` selects and `mlp_only_layers` does not
name, a dense MLP on the rest. The router is a softmax over all experts, top k, the k
weights renormalised when `norm_topk_prob` is set."""

from __future__ import annotations

from torch import nn

from engine.models.llama import LlamaMLP
from engine.models.mixtral import SparseMoeBlock
from engine.models.moe import num_experts, per_expert_target
from engine.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM


def is_sparse_layer(config, layer_idx: int) -> bool:
    return layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and num_experts(config) > 0 \
        and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return SparseMoeBlock(config, config.moe_intermediate_size, renormalize=config.norm_topk_prob)
        return LlamaMLP(config)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
    expert_projections = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def remap_checkpoint_weight(self, name: str, tensor) -> list[tuple[str, object, object]] | None:
        """(parameter, tensor, part) for an expert's tensor; None for the rest."""
        target = per_expert_target(name, self.expert_projections)
        return None if target is None else [(target[0], tensor, target[1])]
