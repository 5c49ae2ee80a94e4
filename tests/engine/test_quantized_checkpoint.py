"""fp8, compressed-tensors (int8, fp8, packed int4), AWQ and GPTQ checkpoints load, dequantized at load
(engine/quantized_checkpoint.py): a tiny Llama quantized here in each layout, from each format's
spec, generates exactly what the same model with the dequantized weights (computed here, block by
block) generates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams

FP8_MAX, BLOCK = 448.0, [32, 32]
PROMPTS = [[1, 5 + i, 9, 13 + 2 * i, 7] for i in range(6)]


def absmax_scale(w: torch.Tensor, top: float, dim: int | None) -> torch.Tensor:
    peak = w.abs().amax() if dim is None else w.abs().amax(dim=dim, keepdim=True)
    return (peak / top).clamp(min=1e-8)


def fp8_per_tensor(w):
    scale = absmax_scale(w, FP8_MAX, None)
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale.reshape(1)}, q.float() * scale


def fp8_per_channel(w):
    scale = absmax_scale(w, FP8_MAX, 1)  # [N, 1]
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def fp8_blocks(w):
    """DeepSeek's and Qwen3-FP8's layout: a scale per 32 x 32 block, stored inverted."""
    rows, cols = w.shape
    scale_inv = torch.empty((rows + 31) // 32, (cols + 31) // 32)
    q, reference = torch.empty(w.shape, dtype=torch.float8_e4m3fn), torch.empty(w.shape)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            block = w[32 * i:32 * i + 32, 32 * j:32 * j + 32]
            scale = absmax_scale(block, FP8_MAX, None)
            scale_inv[i, j] = scale
            q[32 * i:32 * i + 32, 32 * j:32 * j + 32] = (block / scale).to(torch.float8_e4m3fn)
            reference[32 * i:32 * i + 32, 32 * j:32 * j + 32] = q[32 * i:32 * i + 32, 32 * j:32 * j + 32].float() * scale
    return {"weight": q, "weight_scale_inv": scale_inv}, reference


def int8_per_channel(w):
    scale = absmax_scale(w, 127.0, 1)
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def int8_groups_with_zero_points(w, group: int = 16):
    """Asymmetric int8 in groups of 16 along the input: (q - zero_point) * scale."""
    rows, cols = w.shape
    grouped = w.reshape(rows, cols // group, group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / 255.0).clamp(min=1e-8)  # [N, K / G]
    zero_point = torch.round(-128 - low / scale).clamp(-128, 127)
    q = torch.round(grouped / scale[..., None] + zero_point[..., None]).clamp(-128, 127)
    reference = ((q - zero_point[..., None]) * scale[..., None]).reshape(rows, cols)
    return {"weight": q.reshape(rows, cols).to(torch.int8), "weight_scale": scale,
            "weight_zero_point": zero_point.to(torch.int8)}, reference


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns (held in int64) as the int32 the checkpoints store."""
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)


def asymmetric(w_in_major: torch.Tensor, bits: int, group_of_row: torch.Tensor, offset: int = 0):
    """[K, N] -> integer values, zero points and fp16 scales per (group, column), the zero points at
    least `offset` (GPTQ's format stores them minus one)."""
    top = 2**bits - 1
    num_groups = int(group_of_row.max()) + 1
    low = torch.stack([w_in_major[group_of_row == g].amin(0) for g in range(num_groups)])
    high = torch.stack([w_in_major[group_of_row == g].amax(0) for g in range(num_groups)])
    scale = ((high - low) / top).clamp(min=1e-4).half().float()
    zero = torch.round(-low / scale).clamp(offset, top)
    q = torch.round(w_in_major / scale[group_of_row] + zero[group_of_row]).clamp(0, top)
    return q.long(), zero.long(), scale, (q - zero[group_of_row]) * scale[group_of_row]


def awq(w, group: int = 16):
    """AutoAWQ's GEMM packing: along N, nibble i of word j holding column 8j + (0 2 4 6 1 3 5 7)[i]."""
    q, zero, scale, reference = asymmetric(w.t(), 4, torch.arange(w.shape[1]) // group)

    def pack(values):
        words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.long)
        for word in range(words.shape[1]):
            for nibble, column in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
                words[:, word] |= values[:, 8 * word + column] << (4 * nibble)
        return to_int32(words)

    return {"qweight": pack(q), "qzeros": pack(zero), "scales": scale.half()}, reference.t()


def gptq(w, bits: int = 4, group: int = 16, desc_act: bool = False):
    """GPTQ's packing: qweight along K, qzeros along N, both low bits first; zeros stored minus one.
    With desc_act, input rows belong to groups in a shuffled order (g_idx)."""
    rows = w.shape[1]
    group_of_row = torch.arange(rows) // group
    if desc_act:
        group_of_row = group_of_row[torch.randperm(rows, generator=torch.Generator().manual_seed(0))]
    q, zero, scale, reference = asymmetric(w.t(), bits, group_of_row, offset=1)
    per_word = 32 // bits

    def pack(values, dim):
        values = values if dim == 0 else values.t()
        words = torch.zeros(values.shape[0] // per_word, values.shape[1], dtype=torch.long)
        for i in range(per_word):
            words |= values[i::per_word] << (bits * i)
        return to_int32(words if dim == 0 else words.t())

    parts = {"qweight": pack(q, 0), "qzeros": pack(zero - 1, 1), "scales": scale.half(),
             "g_idx": group_of_row.to(torch.int32)}
    return parts, reference.t()


def packed_int4(w, group: int = 16, symmetric: bool = True):
    """llm-compressor's W4A16 (pack-quantized): int4 in groups along the input, packed by the
    compressed-tensors library's own pack_to_int32; asymmetric zero points packed along N."""
    rows, cols = w.shape
    grouped = w.reshape(rows, cols // group, group)
    if symmetric:
        scale, zero_point = (grouped.abs().amax(-1) / 7.0).clamp(min=1e-8), torch.zeros(rows, cols // group)
    else:
        low, high = grouped.amin(-1), grouped.amax(-1)
        scale = ((high - low) / 15.0).clamp(min=1e-8)
        zero_point = torch.round(-8 - low / scale).clamp(-8, 7)
    q = torch.round(grouped / scale[..., None] + zero_point[..., None]).clamp(-8, 7)
    reference = ((q - zero_point[..., None]) * scale[..., None]).reshape(rows, cols)
    parts = {"weight_packed": pack_to_int32(q.reshape(rows, cols).to(torch.int8), 4),
             "weight_shape": torch.tensor([rows, cols]), "weight_scale": scale}
    if not symmetric:
        parts["weight_zero_point"] = pack_to_int32(zero_point.to(torch.int8), 4, packed_dim=0)
    return parts, reference


W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16}}}}

LAYOUTS = {
    "compressed-tensors w4a16": (W4A16, packed_int4),
    "compressed-tensors w4a16 asymmetric": (W4A16, lambda w: packed_int4(w, symmetric=False)),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm"}, awq),
    "gptq 4 bits": ({"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False}, gptq),
    "gptq 8 bits, desc_act": ({"quant_method": "gptq", "bits": 8, "group_size": 16, "desc_act": True},
                              lambda w: gptq(w, bits=8, desc_act=True)),
    "fp8 per tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, fp8_per_tensor),
    "fp8 per channel": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, fp8_per_channel),
    "fp8 blocks": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": BLOCK}, fp8_blocks),
    "compressed-tensors int8": ({"quant_method": "compressed-tensors", "format": "int-quantized"}, int8_per_channel),
    "compressed-tensors int8 groups": ({"quant_method": "compressed-tensors", "format": "int-quantized"},
                                       int8_groups_with_zero_points),
    "compressed-tensors fp8": ({"quant_method": "compressed-tensors", "format": "float-quantized"},
                               fp8_per_channel),
}


def write_pair(source: str, root: Path, quantization: dict, quantize) -> tuple[str, str]:
    """The checkpoint quantized in one layout (and an input_scale, as static-activation exports
    carry), and the same model with the weights dequantized here."""
    quantized_dir, reference_dir = root / "quantized", root / "reference"
    for folder in (quantized_dir, reference_dir):
        shutil.copytree(source, folder)
    weights = load_file(str(Path(source) / "model.safetensors"))
    quantized, reference = {}, {}
    for name, tensor in weights.items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            parts, dequantized = quantize(tensor.float())
            prefix = name.removesuffix(".weight")
            quantized.update({f"{prefix}.{part}": value.contiguous() for part, value in parts.items()})
            quantized[f"{prefix}.input_scale"] = torch.ones(1)
            reference[name] = dequantized
        else:
            quantized[name] = reference[name] = tensor
    save_file(quantized, str(quantized_dir / "model.safetensors"))
    save_file(reference, str(reference_dir / "model.safetensors"))
    config = json.loads((quantized_dir / "config.json").read_text())
    (quantized_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return str(quantized_dir), str(reference_dir)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_quantized_checkpoint_generates_what_its_dequantized_weights_do(tiny_llama, tmp_path, layout):
    quantization, quantize = LAYOUTS[layout]
    quantized, reference = write_pair(tiny_llama, tmp_path, quantization, quantize)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    llm = LLM(quantized, num_kv_blocks=64, quantized_kernels=False)
    assert f"parameters ({quantization['quant_method']} checkpoint, dequantized at load)" in llm.engine.describe()
    got = llm.generate(PROMPTS, params)
    expected = LLM(reference, num_kv_blocks=64).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in expected]


def test_a_layout_it_cannot_read_is_one_line(tiny_llama, tmp_path):
    quantized, _ = write_pair(tiny_llama, tmp_path, {"quant_method": "compressed-tensors", "format": "marlin-24"},
                              int8_per_channel)
    with pytest.raises(ValueError, match="^model: compressed-tensors format 'marlin-24' is not supported yet"):
        LLM(quantized)
    weights = load_file(str(Path(quantized) / "model.safetensors"))
    del weights["model.layers.0.self_attn.q_proj.weight_scale"]
    save_file(weights, str(Path(quantized) / "model.safetensors"))
    config = json.loads((Path(quantized) / "config.json").read_text())
    config["quantization_config"]["format"] = "int-quantized"
    (Path(quantized) / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.q_proj': a quantized weight needs its weight "
                                         "and its scale"):
        LLM(quantized)


@pytest.mark.parametrize("architecture, layout", [("qwen3", "awq"), ("qwen3_moe", "gptq 4 bits"),
                                                  ("qwen3_moe", "fp8 blocks"), ("qwen3", "compressed-tensors int8")])
def test_a_qwen3_and_a_moe_s_quantized_experts_load_too(tiny_models, tmp_path, architecture, layout):
    """Every projection of the model quantized: attention, dense MLPs, and each expert's."""
    quantization, quantize = LAYOUTS[layout]
    quantized, reference = write_pair(tiny_models[architecture], tmp_path, quantization, quantize)
    assert any(".experts." in name and name.endswith(("qweight", "weight_scale_inv"))
               for name in load_file(str(Path(quantized) / "model.safetensors"))) == (architecture == "qwen3_moe")
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2)
    got = LLM(quantized, num_kv_blocks=64, quantized_kernels=False).generate(PROMPTS, params)
    expected = LLM(reference, num_kv_blocks=64).generate(PROMPTS, params)
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got] == [
        (o.outputs[0].token_ids, o.outputs[0].logprobs) for o in expected]


@pytest.mark.parametrize("layout, backend", [
    *[(layout, "auto") for layout in ("awq", "gptq 4 bits", "gptq 8 bits", "gptq 8 bits, desc_act",
                                      "compressed-tensors int8", "compressed-tensors int8 groups",
                                      "compressed-tensors w4a16", "compressed-tensors w4a16 asymmetric")],
    # The Triton matmuls (kvfleet_kernels/quantized_matmul.py), as on CUDA, in the interpreter.
    *[(layout, "triton") for layout in ("awq", "gptq 8 bits, desc_act")]])
def test_integer_weights_stay_packed_on_the_quantized_kernels(tiny_llama, tmp_path, layout, backend):
    """--quantized-kernels: every projection keeps its integer codes, scales and zero points (a = s,
    b = s z, the codes shifted to unsigned for compressed-tensors' signed ones), and greedy answers
    stay within a near-tie of the same checkpoint dequantized at load, with the CPU's kernels or
    Triton's."""
    from engine.quantized_linear import QuantizedLinear  # noqa: PLC0415
    from tests.engine.test_tensor_parallel import close_or_identical, top5  # noqa: PLC0415

    quantization, quantize = LAYOUTS.get(layout) or (
        {"quant_method": "gptq", "bits": 8, "group_size": 16, "desc_act": False}, lambda w: gptq(w, bits=8))
    quantized, _ = write_pair(tiny_llama, tmp_path, quantization, quantize)
    kept = LLM(quantized, num_kv_blocks=64, quantized_kernels=True, attention_backend=backend)
    layers = kept.engine.model_runner.model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, QuantizedLinear) and isinstance(layers[0].mlp.down_proj,
                                                                                    QuantizedLinear)
    assert layers[0].mlp.down_proj.kernel == ("triton" if backend == "triton" else "cpu")
    bits = 4 if "w4a16" in layout else quantization.get("bits", 8)
    assert f"({quantization['quant_method']} {bits}-bit kept quantized" in kept.engine.describe()
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=5)
    got = kept.generate(PROMPTS, params)
    expected = LLM(quantized, num_kv_blocks=64, quantized_kernels=False, attention_backend=backend).generate(PROMPTS, params)
    for a, b in zip(got, expected):
        a, b = a.outputs[0], b.outputs[0]
        close, _ = close_or_identical(a.token_ids, [top5(e) for e in a.logprobs], b.token_ids,
                                      [top5(e) for e in b.logprobs])
        assert close


@pytest.mark.parametrize(("layout", "bits", "desc_act"), [("awq", 4, False), ("gptq", 4, False), ("gptq", 8, False),
                                                         ("gptq", 4, True)])
def test_a_packed_module_keeps_its_codes_and_its_values(layout, bits, desc_act):
    """The kernels' form of an AWQ/GPTQ module (codes, a = s, b = s z) stands for the values the
    packer wrote, b rounded once to fp16; with desc_act its columns come sorted by group, each
    group whole, and input_order puts them back."""
    from engine.quantized_checkpoint import packed_quantized_weight  # noqa: PLC0415

    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(3))
    parts, reference = awq(weight) if layout == "awq" else gptq(weight, bits=bits, desc_act=desc_act)
    kept = packed_quantized_weight(parts, {"quant_method": layout, "bits": bits, "group_size": 16})
    assert kept.codes.dtype == torch.uint8 and kept.scale.shape == (48, 4) and kept.bits == bits
    assert (kept.input_order is not None) == desc_act
    assert torch.allclose(kept.dequantize(), reference.float(), rtol=0, atol=2 ** -10 * reference.abs().max())


@pytest.mark.parametrize("layout", ["awq", "gptq 8 bits, desc_act", "compressed-tensors w4a16 asymmetric"])
def test_a_moe_s_packed_experts_stay_packed_on_the_quantized_kernels(tiny_models, tmp_path, layout):
    """Qwen3-MoE with every expert's projections packed: each expert keeps its codes, its gate and
    up parts in one QuantizedLinear and its down projection in another (GPTQ's desc_act order each
    its own), the parameter counts are the dequantized load's, and greedy answers stay within a
    near-tie of it."""
    from engine.quantized_linear import QuantizedExperts  # noqa: PLC0415
    from tests.engine.test_tensor_parallel import close_or_identical, top5  # noqa: PLC0415

    quantization, quantize = LAYOUTS[layout]
    quantized, _ = write_pair(tiny_models["qwen3_moe"], tmp_path, quantization, quantize)
    kept = LLM(quantized, num_kv_blocks=64, quantized_kernels=True)
    dense = LLM(quantized, num_kv_blocks=64, quantized_kernels=False)
    sparse = [layer.mlp.experts for layer in kept.engine.model_runner.model.model.layers if hasattr(layer.mlp, "experts")]
    assert len(sparse) == 2  # layer 1 is dense (mlp_only_layers)
    bits = 8 if "8 bits" in layout else 4
    for experts in sparse:
        assert isinstance(experts.quantized, QuantizedExperts) and experts.w13_weight is None
        assert {(part.bits, part.in_features) for linear in experts.quantized.w13 for part in linear.parts} == {(bits, 64)}
        assert {(part.bits, part.in_features) for linear in experts.quantized.w2 for part in linear.parts} == {(bits, 32)}
        ordered = [part.input_order is not None for linear in experts.quantized.w13 for part in linear.parts]
        assert all(ordered) == ("desc_act" in layout)
    runners = kept.engine.model_runner, dense.engine.model_runner
    assert len({(runner.num_params, runner.num_active_params) for runner in runners}) == 1
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=5)
    for a, b in zip(kept.generate(PROMPTS, params), dense.generate(PROMPTS, params)):
        a, b = a.outputs[0], b.outputs[0]
        close, _ = close_or_identical(a.token_ids, [top5(e) for e in a.logprobs], b.token_ids,
                                      [top5(e) for e in b.logprobs])
        assert close
