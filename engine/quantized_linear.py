"""Linears and embeddings that keep a checkpoint's quantized weights as they are in memory (4 or
8 bits a weight and an fp16 scale and offset a group) and compute on them with
kvfleet_kernels/cpu_quantized_linear.py: a decode step reads the file's bytes, not 3.5x them.

`swap_in_quantized_layers` swaps, before the weights load, every nn.Linear and nn.Embedding whose
checkpoint sources are all quantized in a form the kernels take for QuantizedLinear or
QuantizedEmbedding: a GGUF file's kernel types (engine/gguf_loader.py, engine/quantized_weights.py)
or an AWQ/GPTQ checkpoint's packed modules (engine/loader.py, engine/quantized_checkpoint.py). The
loaders then hand those sources to them (`checkpoint_parts`) instead of dequantizing. A merged
projection (q/k/v, gate/up) keeps one packed weight a part, since a Q4_K_M file mixes types within
one (Q6_K values beside Q4_K queries). A head tied to a quantized embedding shares its packed
weight. LoRA adapters wrap a QuantizedLinear as any linear (engine/lora/layers.py): the delta adds in
the model's dtype beside the quantized product, as vLLM does. Under tensor parallelism and for MoE
experts, weights are dequantized at load as before (model_runner decides). On CUDA (and under TRITON_INTERPRET=1 with the triton
attention backend) the same modules compute with kvfleet_kernels/quantized_matmul.py instead
(`kernel="triton"`): codes two a byte, dequantized a tile at a time in registers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet_kernels import cpu_quantized_linear as kernels

KERNELS = ("cpu", "triton")


def pack_for(kernel: str, weight: kernels.QuantizedWeight):
    """A QuantizedWeight in the form `kernel`'s matmuls read (on the host; move_quantized_weights
    takes the Triton ones to the model's device)."""
    if kernel == "cpu":
        return kernels.pack_weight(weight)
    from kvfleet_kernels import quantized_matmul  # noqa: PLC0415 (imports triton)

    return quantized_matmul.pack_weight(weight)

# Which kernel a step's rows take (kvfleet_kernels/cpu_quantized_linear.py). The integer dot
# products cost the same for each row; on AMX the tiles take 16 rows for the price of one after a
# panel's dequantization; for prefill-sized steps, dequantizing each weight whole into a scratch
# buffer for oneDNN's blocked matmul wins, since the tile path streams x once a panel. Measured on a
# 2-core Xeon with AMX over a 1B model's four linears of a layer (Q4), ms at 1 / 4 / 16 / 64 / 256 /
# 1024 rows: integer 0.8 / 1.4 / 4.8 / 19; AMX 3.6 / 3.4 / 3.6 / 6.0 / 22 / 152; dense 16 / 23 / 70
# at 64 / 256 / 1024 (bf16 brgemm linears on dense weights: 2.6 / 2.7 / 2.7 / 5.5 / 16).
AMX_ROWS = 20
AMX_DENSE_ROWS = 256
# Without AMX: rows from which steps take the dense path.
DENSE_ROWS = 128


def integer_rows_below() -> int:
    """Steps of fewer rows take the integer dot products (on AMX hosts, more take the tiles; elsewhere
    the dense path)."""
    return AMX_ROWS if kernels.amx_available() else DENSE_ROWS


class QuantizedLinear(nn.Module):
    """x [T, in_features] @ W^T + bias for W quantized, in parts of `part_sizes` output features
    (one per checkpoint tensor), each packed once at load."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: nn.Parameter | None, kernel: str = "cpu",
                 lora_part_sizes: list[int] | None = None) -> None:
        super().__init__()
        self.in_features, self.part_sizes, self.out_features = in_features, list(part_sizes), sum(part_sizes)
        # The projections a LoRA adapter sees in it (q, k, v), whatever tensors the checkpoint split it into
        self.lora_part_sizes = list(lora_part_sizes or part_sizes)
        self.kernel = kernel  # cpu (kvfleet_kernels/cpu_quantized_linear.py) or triton (quantized_matmul.py)
        self.parts: list[kernels.PackedQuantizedWeight | None] = [None] * len(part_sizes)
        self.bias = bias  # the replaced linear's parameter, still filled by engine/loader.py
        self.checkpoint_parts: dict[str, int] = {}  # checkpoint source -> part, set by swap_in_quantized_layers
        # None: x's dtype (bf16, else fp32). fp32 for a head: its sums are fp32, and logits rounded to
        # bf16 tie at an eighth of a logit, where greedy picks by token id (SmolLM2's "The capital"
        # and "L'Étoile" fell on one bf16 value once a prompt's prefix came from the cache).
        self.out_dtype: torch.dtype | None = None
        # The parts' arguments as the kernels take them, built once (a decode step makes ~120 calls of
        # ~15-40 us on a small model, where rebuilding five lists a call cost a few us each), or None
        # while not built or where a part reorders its inputs (GPTQ desc_act: a call a part).
        self._arguments: tuple | None = None
        # _dense's slices of each part, for the element size they were cut for
        self._chunks: tuple[int, list[list[kernels.PackedQuantizedWeight]]] | None = None

    def load_part(self, part: int, weight: kernels.QuantizedWeight) -> None:
        expected = (self.part_sizes[part], self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"shape {tuple(weight.shape)}, the model expects {expected}")
        self.set_packed_part(part, pack_for(self.kernel, weight))

    def set_packed_part(self, part: int, packed: kernels.PackedQuantizedWeight) -> None:
        self.parts[part] = packed
        self._arguments = None  # the kernel's per-part arguments, rebuilt at the next call
        self._chunks = None  # the dense path's column slices of each part, too

    def missing_parts(self) -> list[int]:
        return [index for index, part in enumerate(self.parts) if part is None]

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts if part is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features] in x's dtype (bf16, else fp32)"""
        if self.kernel == "triton":
            return self._triton(x)
        dtype = self.out_dtype or (torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32)
        bias = None if self.bias is None else self.bias.detach().float()
        rows, amx_host = x.shape[0], kernels.amx_available()
        if rows >= (AMX_DENSE_ROWS if amx_host else DENSE_ROWS):
            return self._dense(x.to(dtype), bias)
        amx = rows >= integer_rows_below()
        out = x.new_empty((rows, self.out_features), dtype=dtype)
        if self._arguments is None and all(weight.input_order is None for weight in self.parts):
            self._arguments = kernels.parts_arguments(self.parts)
        if self._arguments is not None:  # every part in one call
            if amx:
                return kernels.linear_amx_parts(x.to(torch.bfloat16).contiguous(), self.parts, bias, out,
                                                self._arguments)
            return kernels.linear_parts(kernels.quantize_activations(x), self.parts, bias, out, self._arguments)
        return self._part_by_part(x, bias, out, amx)

    def _part_by_part(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, amx: bool) -> torch.Tensor:
        """Parts whose inputs come reordered (GPTQ desc_act), each in its own call."""
        inputs = {}  # id(input order) -> x in that order, as the kernel takes it: once for every part
        start = 0
        for weight in self.parts:
            end = start + weight.out_features
            part_bias, part_out = None if bias is None else bias[start:end], out[:, start:end]
            if id(weight.input_order) not in inputs:
                ordered = x if weight.input_order is None else x.index_select(1, weight.input_order)
                inputs[id(weight.input_order)] = ordered.to(torch.bfloat16).contiguous() if amx \
                    else kernels.quantize_activations(ordered)
            if amx:
                kernels.linear_amx(inputs[id(weight.input_order)], weight, part_bias, part_out)
            else:
                kernels.linear(inputs[id(weight.input_order)], weight, part_bias, part_out)
            start = end
        return out

    def _triton(self, x: torch.Tensor) -> torch.Tensor:
        from kvfleet_kernels.quantized_matmul import quantized_matmul  # noqa: PLC0415

        out = x.new_empty((x.shape[0], self.out_features))
        start = 0
        for weight in self.parts:
            quantized_matmul(x, weight, out[:, start:start + weight.out_features])
            start += weight.out_features
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _dense(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Each part dequantized a slice of columns at a time (DENSE_CHUNK_BYTES) into a scratch
        buffer, each slice multiplied as soon as it is written, while it sits in the cache."""
        if self._chunks is None or self._chunks[0] != x.element_size():
            self._chunks = (x.element_size(), [
                kernels.column_chunks(weight, dense_chunk_columns(weight.in_features, x.element_size()))
                for weight in self.parts])
        outs = []
        for weight, chunks in zip(self.parts, self._chunks[1], strict=True):
            inputs = x if weight.input_order is None else x.index_select(1, weight.input_order)
            for chunk in chunks:
                scratch = dense_scratch(chunk.out_features * chunk.in_features, x.dtype)
                outs.append(F.linear(inputs, kernels.dequantize_weight(chunk, scratch.view(chunk.out_features, -1))))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out if bias is None else out + bias.to(out.dtype)

    def extra_repr(self) -> str:
        kinds = sorted({f"{part.bits}-bit/{part.group_size}" for part in self.parts if part is not None})
        return f"in_features={self.in_features}, out_features={self.out_features}, parts={self.part_sizes}, {kinds}"


# The dense path's slice of a weight, dequantized then multiplied while it is still in the cache:
# on a 2-core Zen 3 (32 MiB L3, fp32), 256 rows of a 1B model's gate_up (16384x2048, Q4) took 267 ms
# dequantized whole (134 MB written to memory, then read back) and 213 ms in 8 MiB slices; qkv
# (3072x2048) 45 -> 37 ms; down (2048x8192) the same either way. The outputs are identical.
DENSE_CHUNK_BYTES = 8 * 2**20


def dense_chunk_columns(in_features: int, element_size: int) -> int:
    """Output columns of a DENSE_CHUNK_BYTES slice, a multiple of 16 (a panel), at least one panel."""
    return max(16, DENSE_CHUNK_BYTES // (in_features * element_size) // 16 * 16)


_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def dense_scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """One flat buffer per dtype, grown to the largest weight dequantized so far and reused by
    every layer after it (steps run one linear at a time), so that steps of many rows do not
    fault in a fresh weight-sized allocation per layer."""
    buffer = _SCRATCH.get(dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = _SCRATCH[dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


class QuantizedEmbedding(nn.Module):
    """An embedding table kept quantized: each step dequantizes only the rows it looks up. A
    head tied to it (`tie`) computes on the same packed weight."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, kernel: str = "cpu") -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype, self.kernel = num_embeddings, embedding_dim, dtype, kernel
        self.weight: kernels.PackedQuantizedWeight | None = None
        self.checkpoint_parts: dict[str, int] = {}
        self._tied_heads: list[QuantizedLinear] = []  # a plain list: not submodules

    def tie(self, head: QuantizedLinear) -> None:
        self._tied_heads.append(head)

    def load_part(self, part: int, weight: kernels.QuantizedWeight) -> None:
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(weight.shape) != expected:
            raise ValueError(f"shape {tuple(weight.shape)}, the model expects {expected}")
        self.weight = pack_for(self.kernel, weight)
        for head in self._tied_heads:
            head.set_packed_part(0, self.weight)

    def missing_parts(self) -> list[int]:
        return [0] if self.weight is None else []

    @property
    def nbytes(self) -> int:
        return 0 if self.weight is None else self.weight.nbytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, embedding_dim] in the model's dtype"""
        if self.kernel == "triton":
            from kvfleet_kernels.quantized_matmul import dequantize_rows  # noqa: PLC0415

            return dequantize_rows(self.weight, ids).to(self.dtype)
        return kernels.dequantize_rows(self.weight, ids).to(self.dtype)


class QuantizedExperts(nn.Module):
    """The experts of an MoE layer kept quantized (engine/models/moe.py's FusedMoE holds it): per
    expert, one QuantizedLinear of its gate and up parts (w13, gate's features first, as the stacked
    layout's) and one of its down projection (w2), each packed apart. Its checkpoint sources are
    each expert's own modules (AWQ, GPTQ, compressed-tensors) or tensors that stack every expert's
    weight of one projection (GGUF's `ffn_gate_exps`), which engine/gguf_loader.py reads an expert
    at a time."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, kernel: str = "cpu") -> None:
        super().__init__()
        self.num_experts, self.kernel = num_experts, kernel
        self.w13 = nn.ModuleList(QuantizedLinear(hidden_size, [intermediate_size] * 2, None, kernel)
                                 for _ in range(num_experts))
        self.w2 = nn.ModuleList(QuantizedLinear(intermediate_size, [hidden_size], None, kernel)
                                for _ in range(num_experts))
        self.checkpoint_parts: dict[str, int | tuple[int, int]] = {}  # source -> (expert, role), or role: every expert
        self.inputs_in_order: bool | None = None  # no part reorders its inputs (engine/quantized_experts.py sets it)

    def load_part(self, part: tuple[int, int], weight: kernels.QuantizedWeight) -> None:
        """part (expert, 0 / 1 / 2): that expert's gate / up / down weight."""
        expert, role = part
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert}: the model has {self.num_experts} experts a layer")
        linear = self.w2[expert] if role == 2 else self.w13[expert]
        linear.load_part(0 if role == 2 else role, weight)

    def missing_parts(self) -> list[int]:
        return sorted({*(p for linear in self.w13 for p in linear.missing_parts()),
                       *(2 for linear in self.w2 if linear.missing_parts())})


def quantized_modules(model: nn.Module) -> list[QuantizedLinear | QuantizedEmbedding]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear | QuantizedEmbedding)]


def packed_weights(model: nn.Module) -> list[kernels.PackedQuantizedWeight]:
    """The packed weights the model holds, each once (a tied head shares its table's)."""
    weights = {}
    for module in quantized_modules(model):
        for weight in module.parts if isinstance(module, QuantizedLinear) else [module.weight]:
            if weight is not None:
                weights[id(weight)] = weight
    return list(weights.values())


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the packed weights the model holds."""
    return sum(weight.nbytes for weight in packed_weights(model))


def quantized_values(model: nn.Module) -> int:
    """Weights the packed parts hold: the parameters engine/loader.py never saw."""
    return sum(weight.out_features * weight.in_features for weight in packed_weights(model))


def add_quantized_counts(counts, model: nn.Module) -> None:
    """The weights kept quantized, which engine/loader.py never saw, into its ParameterCounts:
    every one in `total`, an MoE's experts also in `experts`."""
    counts.total += quantized_values(model)
    counts.experts += sum(part.out_features * part.in_features for module in model.modules()
                          if isinstance(module, QuantizedExperts) for linear in [*module.w13, *module.w2]
                          for part in linear.parts if part is not None)


def finish_quantized_load(model: nn.Module, device: torch.device) -> None:
    """Once the checkpoint is read: every quantized module must have all its parts, and the Triton
    modules' packed weights go to the model's device (the loaders read them on the host; a tied
    head's table moves once)."""
    moved = {}
    for module in [m for m in model.modules() if isinstance(m, QuantizedExperts)] + quantized_modules(model):
        if module.missing_parts():
            raise ValueError(f"checkpoint is missing weights for a quantized {type(module).__name__} "
                             f"(parts {module.missing_parts()} of {sorted(module.checkpoint_parts)})")
        if isinstance(module, QuantizedExperts) or module.kernel != "triton":
            continue
        weights = module.parts if isinstance(module, QuantizedLinear) else [module.weight]
        for index, weight in enumerate(weights):
            if id(weight) not in moved:
                moved[id(weight)] = weight.to(device)
            weights[index] = moved[id(weight)]
        if isinstance(module, QuantizedEmbedding):
            module.weight = weights[0]


def checkpoint_receivers(model: nn.Module) -> dict[str, tuple[QuantizedLinear | QuantizedEmbedding, int]]:
    """Checkpoint source -> (the quantized module that takes it, its part), for the loaders."""
    return {source: (module, part) for module in model.modules()
            if isinstance(module, QuantizedLinear | QuantizedEmbedding | QuantizedExperts)
            for source, part in module.checkpoint_parts.items()}


def swap_in_quantized_layers(model: nn.Module, sources_of, dtype: torch.dtype, kernel: str = "cpu") -> set[str]:
    """Swap every nn.Linear / nn.Embedding of `model` for which `sources_of(module name)` names its
    checkpoint sources ({source: part}; {} to keep it) for a quantized module that will receive
    them by those names and compute with `kernel`'s matmuls; a head tied to a swapped embedding
    shares its table. Returns the sources."""
    swapped, kept = {}, set()
    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding)]:
        sources = sources_of(name)
        if not sources or module.weight.shape[-1] % 32:
            continue
        if isinstance(module, nn.Embedding):
            replacement = QuantizedEmbedding(module.num_embeddings, module.embedding_dim, dtype, kernel)
        else:
            sizes = getattr(module, "sizes", [module.out_features])  # a merged projection's parts
            replacement = QuantizedLinear(module.in_features, sizes if len(sizes) == len(sources) else
                                          [module.out_features], module.bias, kernel,  # one checkpoint tensor: one part
                                          lora_part_sizes=sizes)
        replacement.checkpoint_parts = sources
        if name.rpartition(".")[2] == "lm_head":
            replacement.out_dtype = torch.float32  # logits
        swapped[id(module.weight)] = replacement
        model.set_submodule(name, replacement)
        kept.update(sources)
    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        table = swapped.get(id(module.weight))  # a head tied to a table swapped above
        if isinstance(table, QuantizedEmbedding):
            head = QuantizedLinear(module.in_features, [module.out_features], module.bias, kernel)
            head.out_dtype = torch.float32  # logits
            table.tie(head)
            model.set_submodule(name, head)
    return kept


def weight_sources(model: nn.Module, module_name: str, source_of: dict[str, str]) -> dict[str, int]:
    """Checkpoint source -> part for the weight of module `module_name`, `source_of` mapping Hugging
    Face weight names to sources: its own, or those of the projections merged into it (q_proj,
    k_proj, v_proj -> qkv_proj parts 0, 1, 2); {} when any is missing."""
    own = source_of.get(f"{module_name}.weight")
    if own is not None:
        return {own: 0}
    prefix, _, leaf = module_name.rpartition(".")
    parts = sorted((index, source) for source, (fused, index) in getattr(model, "packed_modules", {}).items()
                   if fused == leaf)
    names = [source_of.get(f"{prefix}.{source}.weight") for _, source in parts]
    return {} if not names or None in names else {name: part for name, (part, _) in zip(names, parts, strict=True)}
