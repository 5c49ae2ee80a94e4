"""gpt-oss (gpt-oss-20b, 120b).

What sets it apart:
- attention sinks: a learned logit per head joins every softmax denominator and
  attends to nothing (kvfleet_kernels/reference.py: softmax_with_sinks; every backend);
- sliding-window layers (128 tokens) alternate with full ones by `layer_types`;
  q/k/v and o projections with biases; YaRN RoPE;
- MoE on every layer: a router with a bias takes the top k logits and softmaxes over
  them; experts with biases and a clamped SwiGLU, (up + 1) * gate * sigmoid(1.702 gate).

Checkpoints stack the experts: gate_up_proj [E, H, 2I] with gate and up features
interleaved (even, odd), down_proj [E, I, H], both stored input-major; published ones
are MXFP4 (`*_blocks`, `*_scales`), dequantized on load (engine/mxfp4.py). They are
turned into the stacked [E, 2I, H] / [E, H, I] layout of engine/models/moe.py here.
"""

from __future__ import annotations

import torch
from torch import nn

from engine import parallel
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from engine.models.moe import FusedMoE, TopKRouter, num_experts
from engine.models.parallel_layers import copy_checked, set_loader


class GptOssAttention(LlamaAttention):
    def __init__(self, config, layer_idx: int, sliding_window: int | None) -> None:
        super().__init__(config, layer_idx, sliding_window)
        first = parallel.tp_rank() * self.num_heads  # this rank's heads
        self.sinks = nn.Parameter(torch.empty(self.num_heads))  # [Hq / N]
        set_loader(self.sinks, lambda param, source, _: copy_checked(param, source[first:first + self.num_heads]))


class GptOssMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        experts = num_experts(config)
        self.router = TopKRouter(config.hidden_size, experts, config.num_experts_per_tok, "topk_softmax",
                                 renormalize=False, bias=True)
        self.experts = FusedMoE(experts, config.hidden_size, config.intermediate_size, "swigluoai", bias=True,
                                stacked_checkpoint=True, swiglu_alpha=getattr(config, "swiglu_alpha", 1.702),
                                swiglu_limit=getattr(config, "swiglu_limit", 7.0))  # config fields since 5.x

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> [T, H]"""
        topk_weights, topk_ids = self.router(hidden)
        return self.experts(hidden, topk_weights, topk_ids)


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return GptOssMLP(config)


def deinterleave(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 2I] with gate, up alternating -> (gate [..., I], up [..., I])"""
    return tensor[..., 0::2], tensor[..., 1::2]


class GptOssForCausalLM(LlamaForCausalLM):
    layer_cls = GptOssDecoderLayer

    def remap_checkpoint_weight(self, name: str, tensor) -> list[tuple[str, object, object]] | None:
        """(parameter, tensor, part) for the stacked expert tensors; None for the rest."""
        prefix, _, leaf = name.rpartition(".experts.")
        if not prefix:
            return None
        experts = f"{prefix}.experts"
        full = tensor[:]
        if leaf == "gate_up_proj":  # [E, H, 2I] -> gate, up as [E, I, H]
            gate, up = deinterleave(full)
            return [(f"{experts}.w13_weight", gate.transpose(1, 2), (None, "gate")),
                    (f"{experts}.w13_weight", up.transpose(1, 2), (None, "up"))]
        if leaf == "gate_up_proj_bias":  # [E, 2I]
            gate, up = deinterleave(full)
            return [(f"{experts}.w13_bias", gate, (None, "gate")), (f"{experts}.w13_bias", up, (None, "up"))]
        if leaf == "down_proj":  # [E, I, H] -> [E, H, I]
            return [(f"{experts}.w2_weight", full.transpose(1, 2), (None, "down"))]
        if leaf == "down_proj_bias":
            return [(f"{experts}.w2_bias", full, (None, "down"))]
        return None
