"""The benchmarks' random GGUF files load in kvfleet as the models they stand for (before
llama-quantize): shapes shrunk, the same writer."""

from __future__ import annotations

import pytest

from benchmarks.random_gguf import SHAPES, write_f16
from engine import LLM, SamplingParams


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_random_gguf_loads_as_the_model_it_stands_for(tmp_path, name):
    shape = {**SHAPES[name], "layers": 2, "hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 2,
             "head_dim": 64, **({"experts": 8, "experts_used": 2, "expert_intermediate": 256}
                                if "experts" in SHAPES[name] else {})}
    write_f16(tmp_path / "model.gguf", shape)
    llm = LLM(str(tmp_path / "model.gguf"), num_kv_blocks=64, quantized_kernels=False, skip_tokenizer_init=True)
    config = llm.engine.hf_config
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (2, 256, 2)
    assert config.architectures == [{"1b": "LlamaForCausalLM", "moe": "Qwen3MoeForCausalLM"}[name]]
    if name == "moe":
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 256)
    [output] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(output.token_ids) == 4
