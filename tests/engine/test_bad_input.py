"""Bad input raises ValueError naming the field and the limit; the engine stays usable."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import LLM, ContextLengthExceeded, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=20, max_model_len=300)  # 20 blocks of 16 = 320 slots


@pytest.mark.parametrize("options, field", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"top_k": -3}, "top_k"), ({"min_p": 2.0}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"logprobs": 50}, "logprobs"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"stop": [""]}, "stop"),
])
def test_invalid_sampling_parameter_names_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**options)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="prompts\\[1\\]: prompt: must not be empty"):
        llm.generate([[5, 6], []], use_tqdm=False)


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ContextLengthExceeded, match="exceed max_model_len 300"):
        llm.generate([[5] * 295], SamplingParams(max_tokens=10), use_tqdm=False)


def test_request_needing_more_blocks_than_the_pool(tiny_llama):
    small = LLM(tiny_llama, num_kv_blocks=4)  # 64 slots, while max_model_len is 512
    with pytest.raises(ContextLengthExceeded, match="needs 5 KV blocks .* num_kv_blocks is 4"):
        small.generate([[5] * 60], SamplingParams(max_tokens=10), use_tqdm=False)
    assert small.generate([[5] * 40], SamplingParams(max_tokens=10), use_tqdm=False)[0].finish_reason


def test_token_id_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match="token ids must be integers in \\[0, 512\\)"):
        llm.generate([[5, 512]], use_tqdm=False)


def test_engine_stays_usable_after_rejected_requests(llm):
    with pytest.raises(ValueError):
        llm.generate([[1, 2, 3], []], use_tqdm=False)
    assert not llm.engine.has_unfinished()  # the valid one was not queued either
    engine = llm.engine
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("too-long", [5] * 299, SamplingParams(max_tokens=5))
    engine.add_request("fine", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["fine"] and len(outputs[0].token_ids) == 3
    assert engine.num_free_blocks == engine.num_total_blocks


def test_unknown_architecture(tiny_llama, tmp_path):
    model_dir = Path(shutil.copytree(tiny_llama, tmp_path / "unknown"))
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="architectures \\['FalconForCausalLM'\\] not supported"):
        LLM(str(model_dir))


@pytest.mark.parametrize("quantization, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     "model: bitsandbytes quantization \\(config.json's quantization_config\\) is not supported yet"),
    ({"quant_method": "hqq"}, "model: hqq quantization"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"},
     "model: awq is supported in its GEMM layout, 4 bits with zero points; this checkpoint has version 'gemv'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "model: gptq with 3 bits is not supported yet"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
     "model: compressed-tensors format 'nvfp4-pack-quantized' is not supported yet"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"a": {"weights": {"num_bits": 4}}, "b": {"weights": {"num_bits": 8}}}},
     "model: compressed-tensors pack-quantized weights of one integer width"),
])
def test_a_quantized_checkpoint_it_cannot_load_is_one_line(tiny_llama, tmp_path, quantization, message):
    """Refused before a weight is read (engine/quantized_checkpoint.py: what loads)."""
    model_dir = Path(shutil.copytree(tiny_llama, tmp_path / "quantized"))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"^{message}"):
        LLM(str(model_dir))


@pytest.mark.parametrize("options, message", [
    ({"block_size": 12}, "block_size"), ({"num_kv_blocks": 0}, "num_kv_blocks"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory"), ({"dtype": "int8"}, "dtype"),
    ({"attention_backend": "flash"}, "attention_backend"), ({"max_num_seqs": 0}, "max_num_seqs"),
])
def test_invalid_engine_option(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="unused", **options)


def test_max_model_len_beyond_the_model(tiny_llama):
    with pytest.raises(ValueError, match="max_position_embeddings 512"):
        LLM(tiny_llama, max_model_len=4096)


def test_a_model_path_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="is neither a Hugging Face checkpoint folder"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="kvfleet never downloads weights"):
        LLM("meta-llama/Llama-3.1-8B")


def test_gpt_oss_s_mxfp4_quantization_config_is_accepted(tiny_models, tmp_path):
    """gpt-oss's published checkpoints say quant_method mxfp4: their experts load (engine/mxfp4.py)."""
    model_dir = Path(shutil.copytree(tiny_models["gpt_oss"], tmp_path / "mxfp4"))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (model_dir / "config.json").write_text(json.dumps(config))
    assert LLM(str(model_dir), num_kv_blocks=16).generate([[1, 2, 3]])[0].outputs[0].token_ids
