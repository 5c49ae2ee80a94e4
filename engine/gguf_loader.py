"""Load GGUF checkpoints (llama.cpp's format) into kvfleet's model definitions.

On the CPU, the linears, embeddings and MoE experts whose tensors have a type the quantized
kernels take (engine/quantized_weights.py: Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K) keep them quantized
(`use_quantized_gguf_layers`, engine/quantized_linear.py). Every other tensor (norms, F16/F32
tensors, Q2_K/Q3_K; all of them under tensor parallelism, with LoRA or on CUDA) is
dequantized at load with the `gguf` package's own reader and dequantizers, to float32 and then
the engine's dtype; under tensor parallelism each rank then keeps only its slice.

GGUF names tensors its own way (`blk.0.attn_q.weight`); the map back to Hugging Face names is
gguf's TensorNameMap, inverted over the names the model loads. An MoE layer's experts, which GGUF
stacks in one tensor a projection (`blk.0.ffn_gate_exps.weight`, [E, N, K]), load as a Hugging
Face checkpoint's per-expert tensors (`stacked_expert_names`). Two things llama.cpp's converter
does to tensors are undone here, as transformers does:
- llama: q/k rows are permuted for its rotary layout (interleaved pairs);
- gemma: every RMSNorm weight is stored as 1 + w.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, get_tensor_name_map
from gguf.quants import dequantize
from torch import nn

from engine.quantized_linear import checkpoint_receivers, swap_in_quantized_layers, weight_sources

Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                   Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Tables llama.cpp derives from the config and stores as tensors; kvfleet derives them itself.
DERIVED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# transformers' model_type -> the GGUF architecture name, where they differ.
GGUF_ARCH_OF_MODEL_TYPE = {"gemma3_text": "gemma3"}


@functools.lru_cache(maxsize=1)
def open_reader(path: Path) -> GGUFReader:
    """One parse per file: reading a GGUF's metadata (its vocabulary) takes seconds."""
    return GGUFReader(path)


def read_field(reader: GGUFReader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def complete_config(config, path: Path) -> None:
    """What transformers leaves out of a GGUF's config: the head size (Qwen3 and Gemma 3
    set it apart from hidden / heads), Phi-3's sliding window and partial rotary, and the
    RoPE scaling llama.cpp keeps as tensors: Llama 3's frequency factors, Phi-3's longrope
    factors."""
    reader = open_reader(Path(path))
    arch = read_field(reader, "general.architecture")
    key_length = read_field(reader, f"{arch}.attention.key_length")
    if key_length:
        config.head_dim = int(key_length)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary_dim = read_field(reader, f"{arch}.rope.dimension_count")
    if rotary_dim and int(rotary_dim) < head_dim:  # Phi-4-mini turns 3/4 of each head
        config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": int(rotary_dim) / head_dim}
    expert_width = read_field(reader, f"{arch}.expert_feed_forward_length")
    if expert_width:  # Qwen3-MoE's expert width, which transformers' GGUF config leaves at its default
        config.moe_intermediate_size = int(expert_width)
    window = read_field(reader, f"{arch}.attention.sliding_window")
    if window and getattr(config, "sliding_window", None) is None:  # Phi-3's, which transformers drops
        config.sliding_window = int(window)
    factors = {t.name: t for t in reader.tensors if t.name in DERIVED_TENSORS}
    if "rope_freqs.weight" in factors:  # Llama 3.1's scaled RoPE, as a divisor per frequency
        config.rope_freq_factors = dequantize_tensor(factors["rope_freqs.weight"]).tolist()
    if "rope_factors_long.weight" in factors and "rope_factors_short.weight" in factors:
        original = read_field(reader, f"{arch}.rope.scaling.original_context_length")
        config.rope_parameters = {
            **config.rope_parameters, "rope_type": "longrope",
            "long_factor": dequantize_tensor(factors["rope_factors_long.weight"]).tolist(),
            "short_factor": dequantize_tensor(factors["rope_factors_short.weight"]).tolist(),
            "original_max_position_embeddings": int(original or config.max_position_embeddings),
        }
        config.original_max_position_embeddings = config.rope_parameters["original_max_position_embeddings"]


def as_mixtral_if_experts(config, path: Path):
    """llama.cpp writes Mixtral as a `llama` with experts (`llama.expert_count`), which transformers
    reads as a plain Llama: that config as the MixtralConfig it stands for (its feed-forward length
    is the experts'); any other config as it is."""
    reader = open_reader(Path(path))
    experts = read_field(reader, "llama.expert_count")
    if config.model_type != "llama" or not experts:
        return config
    from transformers import MixtralConfig  # noqa: PLC0415

    fields = {key: value for key, value in config.to_dict().items()
              if key not in ("model_type", "architectures", "transformers_version")}
    return MixtralConfig(**{**fields, "num_local_experts": int(experts),
                            "num_experts_per_tok": int(read_field(reader, "llama.expert_used_count"))})


def check_types(reader: GGUFReader) -> None:
    """One line naming the first tensor whose quantization kvfleet cannot load."""
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise ValueError(f"GGUF tensor {tensor.name}: quantization type {tensor.tensor_type.name} is not "
                             f"supported; supported: {', '.join(t.name for t in SUPPORTED_TYPES)}")


def dequantize_tensor(tensor) -> np.ndarray:
    """A reader tensor as float32 in PyTorch's layout: GGUF shape [ne0, ne1] is [ne1, ne0]."""
    return dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)


def checkpoint_names(model: nn.Module) -> list[str]:
    """The Hugging Face names the model loads: its parameters, with merged projections
    (qkv_proj, gate_up_proj) split back into the checkpoint's q_proj, k_proj, ..."""
    fused_sources: dict[str, list[str]] = {}
    for source, (fused, _) in getattr(model, "packed_modules", {}).items():
        fused_sources.setdefault(fused, []).append(source)
    names = []
    for name, _ in model.named_parameters(remove_duplicate=False):
        for fused, sources in fused_sources.items():
            if f".{fused}." in name:
                names.extend(name.replace(f".{fused}.", f".{source}.") for source in sources)
                break
        else:
            names.append(name)
    return names


def gguf_to_hf_names(model: nn.Module, arch: str, num_layers: int) -> dict[str, str]:
    arch_enum = next((key for key, value in MODEL_ARCH_NAMES.items() if value == arch), None)
    if arch_enum is None:
        raise ValueError(f"GGUF architecture {arch!r} is unknown to the installed gguf package")
    name_map = get_tensor_name_map(arch_enum, num_layers)
    mapping = {}
    for hf_name in checkpoint_names(model):
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(base)
        if gguf_name is not None:
            mapping[f"{gguf_name}.{suffix}"] = hf_name
    return mapping


def stacked_expert_names(model: nn.Module, arch: str, num_layers: int) -> dict[str, tuple[str, str]]:
    """GGUF's stacked expert tensors (`blk.0.ffn_gate_exps.weight`, [E, N, K]) -> (the experts'
    module name, the checkpoint's projection name), e.g. ("model.layers.0.mlp.experts",
    "gate_proj"): each expert's slice loads as the per-expert tensor of a Hugging Face checkpoint."""
    from engine.models.moe import FusedMoE  # noqa: PLC0415

    projections = getattr(model, "expert_projections", {})
    arch_enum = next((key for key, value in MODEL_ARCH_NAMES.items() if value == arch), None)
    if not projections or arch_enum is None:
        return {}
    name_map = get_tensor_name_map(arch_enum, num_layers)
    names = {}
    for prefix, _ in [(n, m) for n, m in model.named_modules() if isinstance(m, FusedMoE)]:
        for projection, role in projections.items():  # Mixtral's w1 is known to the map as gate_proj
            gguf_name = name_map.get_name(f"{prefix}.{projection}") or name_map.get_name(f"{prefix}.{role}_proj")
            if gguf_name is not None:
                names[f"{gguf_name}.weight"] = (prefix, projection)
    return names


def unpermute_rotary(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, its rows went [half, 2] -> [2, half]."""
    half = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def to_hf_layout(arch: str, gguf_name: str, weights: np.ndarray, hf_config) -> np.ndarray:
    if arch == "llama" and ".attn_q." in gguf_name:
        return unpermute_rotary(weights, hf_config.num_attention_heads)
    if arch == "llama" and ".attn_k." in gguf_name:
        return unpermute_rotary(weights, hf_config.num_key_value_heads)
    if arch.startswith("gemma") and gguf_name.endswith("norm.weight"):
        return weights - 1
    return weights


def use_quantized_gguf_layers(model: nn.Module, path: str | Path, hf_config, dtype: torch.dtype,
                              kernel: str = "cpu") -> None:
    """Swap every nn.Linear / nn.Embedding of `model` whose tensors in the GGUF file all have a kernel
    type for a quantized module that will receive them (engine/quantized_linear.py; `kernel` cpu or
    triton)."""
    from engine.quantized_weights import KERNEL_TYPES  # noqa: PLC0415

    reader = open_reader(Path(path))
    types = {tensor.name: tensor.tensor_type for tensor in reader.tensors}
    gguf_of = {hf: gguf for gguf, hf in gguf_to_hf_names(model, read_field(reader, "general.architecture"),
                                                          hf_config.num_hidden_layers).items()}

    def sources_of(name: str) -> dict[str, int]:
        sources = weight_sources(model, name, gguf_of)
        return sources if all(types.get(gguf) in KERNEL_TYPES for gguf in sources) else {}

    kept = swap_in_quantized_layers(model, sources_of, dtype, kernel)
    kept |= keep_experts_quantized(model, types, read_field(reader, "general.architecture"), hf_config, kernel)
    model.quantized_kept = "GGUF " + "/".join(sorted({types[gguf].name for gguf in kept}))


def keep_experts_quantized(model: nn.Module, types: dict, arch: str, hf_config, kernel: str) -> set[str]:
    """Keep quantized the experts of every MoE layer whose three stacked tensors (gate, up, down)
    all have a kernel type (FusedMoE.keep_quantized): their names, which then load into it."""
    from engine.quantized_weights import KERNEL_TYPES  # noqa: PLC0415

    names_of: dict[str, dict[str, str]] = {}  # experts' module -> role -> GGUF name
    for gguf_name, (prefix, projection) in stacked_expert_names(model, arch, hf_config.num_hidden_layers).items():
        names_of.setdefault(prefix, {})[model.expert_projections[projection]] = gguf_name
    kept = set()
    for prefix, names in names_of.items():
        experts = model.get_submodule(prefix)
        if set(names) != {"gate", "up", "down"} or any(types.get(name) not in KERNEL_TYPES for name in names.values()) \
                or experts.w13_weight.shape[-1] % 32 or experts.w2_weight.shape[-1] % 32:
            continue
        experts.keep_quantized(kernel).checkpoint_parts = {names["gate"]: 0, names["up"]: 1, names["down"]: 2}
        kept.update(names.values())
    return kept


def load_quantized(tensor, target, arch: str, hf_config) -> None:
    """A kernel-typed tensor into its quantized module, rows in Hugging Face's order."""
    from engine.quantized_weights import gguf_quantized_weight  # noqa: PLC0415

    module, part = target
    if isinstance(part, int) and len(tensor.data.shape) == 3:  # stacked experts [E, N, bytes]: one at a time
        if len(tensor.data) != module.num_experts:
            raise ValueError(f"GGUF tensor {tensor.name!r}: {len(tensor.data)} experts, the model has {module.num_experts}")
        for expert, blocks in enumerate(tensor.data):
            module.load_part((expert, part), gguf_quantized_weight(blocks, tensor.tensor_type, int(tensor.shape[0])))
        return
    weight = gguf_quantized_weight(tensor.data, tensor.tensor_type, int(tensor.shape[0]))
    if arch == "llama" and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
        heads = hf_config.num_attention_heads if ".attn_q." in tensor.name else hf_config.num_key_value_heads
        for field in ("codes", "scale", "offset"):
            setattr(weight, field, torch.from_numpy(unpermute_rotary(getattr(weight, field).numpy(), heads).copy()))
    try:
        module.load_part(part, weight)
    except ValueError as error:
        raise ValueError(f"GGUF tensor {tensor.name!r}: {error}") from None


def iterate_gguf_weights(path: str | Path, model: nn.Module, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every weight of the GGUF file, dequantized.
    Every type is checked before anything is dequantized; a tensor with no place in the
    model is a ValueError naming it."""
    reader = open_reader(Path(path))
    check_types(reader)
    arch = read_field(reader, "general.architecture")
    names = gguf_to_hf_names(model, arch, hf_config.num_hidden_layers)
    experts = stacked_expert_names(model, arch, hf_config.num_hidden_layers)
    quantized = checkpoint_receivers(model)
    for tensor in reader.tensors:
        if tensor.name in DERIVED_TENSORS:
            continue
        if tensor.name in quantized:
            load_quantized(tensor, quantized[tensor.name], arch, hf_config)
            continue
        if tensor.name in experts:
            prefix, projection = experts[tensor.name]
            for expert, weights in enumerate(dequantize_tensor(tensor)):  # [E, N, K]
                yield f"{prefix}.{expert}.{projection}.weight", torch.tensor(weights)
            continue
        if tensor.name not in names:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no place in {type(model).__name__}")
        weights = to_hf_layout(arch, tensor.name, dequantize_tensor(tensor), hf_config)
        yield names[tensor.name], torch.tensor(weights)  # a copy: F32 tensors are read-only file views
    if quantized:  # the packed copies are all that is kept: let the file's pages go
        open_reader.cache_clear()
