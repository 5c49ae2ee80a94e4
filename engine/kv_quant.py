"""An fp8 KV cache: one byte an element, scaled per layer.

`kv_cache_dtype` (vLLM's names) picks the cache's element type: auto (the model's dtype), fp8
or fp8_e4m3 (torch.float8_e4m3fn, largest 448, 3 mantissa bits) and fp8_e5m2 (largest 57344,
2 mantissa bits). A layer's new keys are stored as key / k_scale rounded to the nearest fp8 value
(clamped to the largest finite one), its values as value / v_scale, and every reader multiplies
back: the CPU decode kernel folds k_scale into its query and v_scale into its output's
normalisation, the Triton kernels convert the bytes and multiply, the torch path dequantizes
what it gathers. Twice the blocks fit in the same memory, and a decode step reads half the KV
bytes.

The scales, one pair a layer, come from the checkpoint where it has them (`k_scale`/`v_scale`
beside each attention's projections, as llm-compressor and ModelOpt write them; an older
`kv_scale` for both), else 1.0, as vLLM does. `calculate_kv_scales` computes them once from the
first step's keys and values instead: their largest magnitude over vLLM's K_SCALE_CONSTANT (200)
and V_SCALE_CONSTANT (100), which leaves room for keys larger than the first prompt's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0  # vLLM's defaults for calculate_kv_scales
# Checkpoint names of the scales: k_scale/v_scale on the attention module (llm-compressor,
# ModelOpt), kv_scale for both (older fp8 exports), or the projections' output_scale (AutoFP8).
_SCALE_NAME = re.compile(r"layers\.(\d+)\..*\b(k_scale|v_scale|kv_scale|k_proj\.output_scale|v_proj\.output_scale)$")


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache for an EngineConfig.kv_cache_dtype."""
    return model_dtype if kv_cache_dtype == "auto" else FP8_KV_DTYPES[kv_cache_dtype]


@dataclass
class KVScales:
    """One layer's scales: stored = x / scale, read = stored * scale. `calculate`: not yet
    known, computed from the first keys and values the layer stores."""

    k: float = 1.0
    v: float = 1.0
    calculate: bool = False

    def observe(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Computes the scales from the first step's key/value [T, Hkv, D], once."""
        if not self.calculate:
            return
        key_max, value_max = key.abs().max().item(), value.abs().max().item()
        if key_max == 0 or value_max == 0:
            return  # a step of padding (a CUDA graph's capture) says nothing of the model's range
        self.k, self.v = key_max / K_SCALE_CONSTANT, value_max / V_SCALE_CONSTANT
        self.calculate = False


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x [T, Hkv, D] -> x / scale in the fp8 `dtype`, rounded to nearest and clamped to its
    largest finite value (e5m2 would round beyond it to inf)."""
    largest = torch.finfo(dtype).max
    if scale == 1.0:  # x is exact in fp32 already: one rounding either way, without the fp32 copy
        return x.clamp(-largest, largest).to(dtype)
    return (x.float() / scale).clamp_(-largest, largest).to(dtype)


def take_kv_scales(weights: Iterator[tuple[str, object]], found: dict[int, dict[str, float]]):
    """The checkpoint's weights with its KV-cache scales taken out into `found`
    ({layer: {"k": scale, "v": scale}}); every other tensor passes on."""
    for name, tensor in weights:
        match = _SCALE_NAME.search(name)
        if match is None:
            yield name, tensor
            continue
        whole = tensor[()] if len(tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape) == 0 \
            else tensor[:]  # a lazy slice takes no [:] when it has no dimension
        value = float(torch.as_tensor(whole).float().max())  # per-tensor: a [1] or [] tensor
        kinds = {"k_scale": "k", "k_proj.output_scale": "k", "v_scale": "v", "v_proj.output_scale": "v",
                 "kv_scale": "kv"}[match.group(2)]
        for kind in ("k", "v") if kinds == "kv" else (kinds,):
            found.setdefault(int(match.group(1)), {})[kind] = value


def layer_kv_scales(attention_layers, found: dict[int, dict[str, float]], calculate: bool) -> None:
    """Gives each attention layer (its `layer_idx`) its KVScales: the checkpoint's, else 1.0 or
    computed from its first keys (`calculate`)."""
    for layer in attention_layers:
        given = found.get(layer.layer_idx, {})
        layer.kv_scale = KVScales(given.get("k", 1.0), given.get("v", 1.0), calculate and not given)
    if not found and not calculate:
        logger.warning("fp8 KV cache with scales of 1.0: the checkpoint gives no k_scale/v_scale "
                       "(--calculate-kv-scales computes them from the first step)")
