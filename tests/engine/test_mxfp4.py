"""MXFP4 (OCP Microscaling): the dequantizer against a decoder written from the spec's
bit layout, over every FP4 code and a range of scales; a gpt-oss checkpoint whose
experts are packed as the published ones are loads and generates as transformers does
on the same values unpacked."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.mxfp4 import dequantize, dequantize_checkpoint
from tests.engine.test_parity import reference_outputs, workload


def spec_value(code: int, scale: int) -> float:
    """FP4 E2M1 (1 sign, 2 exponent bits with bias 1, 1 mantissa bit) times E8M0 2^(scale - 127)."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 0b1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)  # subnormal or normal
    return sign * magnitude * 2.0 ** (scale - 127)


def test_every_code_and_a_range_of_scales_match_the_spec():
    # Rows of 64 values (2 blocks): every byte 0..255 once, so each code sits in both nibbles.
    blocks = torch.arange(256, dtype=torch.uint8).view(8, 2, 16)
    scales = torch.tensor([[0, 1], [60, 100], [120, 126], [127, 128], [129, 140], [160, 200], [230, 250], [3, 77]],
                          dtype=torch.uint8)
    got = dequantize(blocks, scales, torch.float32)
    assert got.shape == (8, 64)
    for row in range(8):
        for group in range(2):
            for byte_index in range(16):
                byte = int(blocks[row, group, byte_index])
                scale = int(scales[row, group])
                low, high = spec_value(byte & 0x0F, scale), spec_value(byte >> 4, scale)  # low nibble first
                position = group * 32 + 2 * byte_index
                assert got[row, position].item() == pytest.approx(low, abs=0, rel=0)
                assert got[row, position + 1].item() == pytest.approx(high, abs=0, rel=0)
    assert torch.signbit(got[0, 16]) and got[0, 16] == 0  # code 8 is -0


def test_bfloat16_holds_the_values_exactly():
    blocks = torch.randint(0, 256, (3, 4, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    scales = torch.randint(100, 150, (3, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(dequantize(blocks, scales, torch.bfloat16).float(), dequantize(blocks, scales, torch.float32))


@pytest.mark.parametrize("blocks, scales, message", [
    (torch.zeros(2, 3, 16, dtype=torch.uint8), torch.full((2, 3), 255, dtype=torch.uint8), "E8M0's NaN"),
    (torch.zeros(2, 3, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8), r"must be \[..., G, 16\]"),
    (torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), "do not match"),
    (torch.zeros(2, 3, 16, dtype=torch.int8), torch.zeros(2, 3, dtype=torch.uint8), "must be uint8"),
])
def test_malformed_tensors_are_clear_errors(blocks, scales, message):
    with pytest.raises(ValueError, match=message):
        dequantize(blocks, scales, torch.float32)


def test_pairs_are_joined_in_any_order_and_a_lone_half_is_an_error():
    blocks = torch.randint(0, 256, (2, 5, 2, 16), dtype=torch.uint8)
    scales = torch.full((2, 5, 2), 127, dtype=torch.uint8)
    weights = [("a.down_proj_scales", scales), ("a.bias", torch.ones(3)), ("a.down_proj_blocks", blocks)]
    out = dict(dequantize_checkpoint(iter(weights), torch.float32))
    assert set(out) == {"a.bias", "a.down_proj"}
    assert torch.equal(out["a.down_proj"], dequantize(blocks, scales, torch.float32).transpose(-1, -2))
    assert out["a.down_proj"].shape == (2, 64, 5)  # [E, in, out], as an unquantized gpt-oss tensor
    with pytest.raises(ValueError, match=r"without their other half: \['b.gate_up_proj'\]"):
        list(dequantize_checkpoint(iter([("b.gate_up_proj_blocks", blocks)]), torch.float32))


FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, in] -> (blocks [..., rows, in / 32, 16], scales [..., rows, in / 32]): each block
    scaled so its largest value is at most 6, every value rounded to the nearest FP4 code."""
    groups = weight.unflatten(-1, (-1, 32))  # [..., rows, G, 32]
    largest = groups.abs().amax(-1).clamp(min=2.0**-100)
    exponents = torch.ceil(torch.log2(largest / 6.0))
    scaled = groups / torch.exp2(exponents).unsqueeze(-1)
    codes = (scaled.abs().unsqueeze(-1) - FP4_MAGNITUDES).abs().argmin(-1)  # nearest magnitude
    codes = codes + 8 * (scaled < 0)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponents + 127).to(torch.uint8)


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_matches_transformers(tiny_models, tmp_path):
    source = tiny_models["gpt_oss"]
    packed_dir, plain_dir = tmp_path / "mxfp4", tmp_path / "plain"
    shutil.copytree(source, packed_dir)
    shutil.copytree(source, plain_dir)
    tensors = load_file(f"{source}/model.safetensors")
    packed, plain = dict(tensors), dict(tensors)
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out]
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2).contiguous())
            del packed[name]
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            plain[name] = dequantize(blocks, scales, torch.float32).transpose(1, 2).contiguous()
            assert (plain[name] - tensor).abs().max() > 0  # really rounded
    save_file(packed, str(packed_dir / "model.safetensors"))
    save_file(plain, str(plain_dir / "model.safetensors"))

    prompts, params = workload(512)
    chosen = random.Random(0).sample(range(len(prompts)), 8)
    prompts, params = [prompts[i] for i in chosen], [params[i] for i in chosen]
    # The weights as loaded (the CPU default then repacks the experts for oneDNN).
    loaded = [dict(LLM(str(path), num_kv_blocks=16, onednn_linear=False).engine.model_runner.model.named_parameters())
              for path in (packed_dir, plain_dir)]
    assert loaded[0].keys() == loaded[1].keys() and any(".experts.w13_weight" in name for name in loaded[0])
    for name, value in loaded[0].items():
        assert torch.equal(value, loaded[1][name]), name
    expected = reference_outputs(str(plain_dir), prompts, params)
    from_packed = LLM(str(packed_dir), num_kv_blocks=256)
    assert [o.token_ids for o in from_packed.generate(prompts, params, use_tqdm=False)] == expected
