"""GGUF checkpoints: every quantization type kvfleet loads equals gguf's own dequantizer
on tensors quantized here; each architecture GGUF carries runs token-identical to
transformers reading the same file; tensor parallelism slices after dequantizing; an
unsupported type, or an ambiguous folder, is a one-line error. All on the loader's dequantizing
path (quantized_kernels=False); the weights kept quantized, the CPU's default: test_quantized_gguf.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Phi3Config

from engine import LLM, SamplingParams
from engine.checkpoint import load_hf_config, load_tokenizer
from engine.demo_model import write_checkpoint
from engine.gguf_loader import SUPPORTED_TYPES
from tests.engine.gguf_files import Q, write_gguf
from tests.engine.test_parity import workload
from tests.engine.test_tensor_parallel import close_or_identical, top5
from tests.tiny_models import TINY_CONFIGS, VOCAB

# Rows of 256 and 512 features: every matrix splits into whole K-quant blocks (256 values).
WIDE_LLAMA = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.05, architectures=["LlamaForCausalLM"])
# What a GGUF can say of Gemma 3 and Phi-3 (no per-type RoPE scaling, query_pre_attn_scalar,
# soft-capping or longrope keys there): the pattern of 5 local layers to 1 global, windows of 48.
GGUF_CONFIGS = {
    "llama": TINY_CONFIGS["llama"], "qwen2": TINY_CONFIGS["qwen2"], "qwen3": TINY_CONFIGS["qwen3"],
    "gemma3": lambda: Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=48, initializer_range=0.1,
        architectures=["Gemma3ForCausalLM"]),
    "phi3": lambda: Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, sliding_window=48, initializer_range=0.1,
        architectures=["Phi3ForCausalLM"]),
    # Every layer sparse (a GGUF of qwen3moe has no dense ones), each expert's tensors stacked in
    # one (ffn_gate_exps ...); top 4 of 8, renormalised, as llama.cpp always does.
    "qwen3_moe": lambda: TINY_CONFIGS["qwen3_moe"]().__class__(**{
        **TINY_CONFIGS["qwen3_moe"]().to_dict(), "mlp_only_layers": [], "num_hidden_layers": 2}),
}
# Mixed as llama.cpp's mixes are: embeddings and attention wider, the MLP narrower.
MIXED_TYPES = {"token_embd": Q.F16, "output": Q.Q8_0, "attn": Q.Q8_0, "ffn_gate_inp": Q.F32, "ffn_gate": Q.Q4_0,
               "ffn_up": Q.Q4_1, "ffn_down": Q.Q5_1}


def mixed_type(name: str, shape) -> Q:
    return next(qtype for part, qtype in MIXED_TYPES.items() if name.startswith(part) or f".{part}" in name)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory, tiny_tokenizer) -> str:
    return str(write_checkpoint(WIDE_LLAMA, tmp_path_factory.mktemp("wide-llama"), seed=2, tokenizer=tiny_tokenizer))


def loaded_weights(path, dtype: str = "float32") -> dict[str, torch.Tensor]:
    llm = LLM(str(path), skip_tokenizer_init=True, quantized_kernels=False, num_kv_blocks=8, dtype=dtype, onednn_linear=False)
    return {name: p.detach() for name, p in llm.engine.model_runner.model.named_parameters()}


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_every_type_loads_as_ggufs_own_dequantizer(wide_llama, tmp_path, qtype):
    written = write_gguf(wide_llama, tmp_path / "model.gguf", lambda name, shape: qtype)
    params = loaded_weights(tmp_path / "model.gguf")
    _, gate = written["blk.0.ffn_gate.weight"]
    _, up = written["blk.0.ffn_up.weight"]
    expected = {"model.layers.0.mlp.gate_up_proj.weight": np.concatenate([gate, up]),
                "model.layers.0.mlp.down_proj.weight": written["blk.0.ffn_down.weight"][1],
                "model.embed_tokens.weight": written["token_embd.weight"][1],
                "lm_head.weight": written["output.weight"][1],
                "model.layers.0.self_attn.o_proj.weight": written["blk.0.attn_output.weight"][1],
                "model.layers.0.input_layernorm.weight": written["blk.0.attn_norm.weight"][1]}
    for name, tensor in expected.items():
        assert torch.equal(params[name], torch.from_numpy(np.ascontiguousarray(tensor))), name


def test_q_and_k_rows_come_back_in_transformers_order_and_bf16_is_a_cast(wide_llama, tmp_path):
    """llama.cpp permutes q/k rows for its rotary layout; an F32 file gives the checkpoint's
    own q/k back exactly. In bfloat16 the engine holds the float32 weights rounded once."""
    write_gguf(wide_llama, tmp_path / "f32.gguf")
    from_gguf, from_safetensors = loaded_weights(tmp_path / "f32.gguf"), loaded_weights(wide_llama)
    assert from_gguf.keys() == from_safetensors.keys()
    for name, tensor in from_safetensors.items():
        assert torch.equal(from_gguf[name], tensor), name
    written = write_gguf(wide_llama, tmp_path / "q4k.gguf", lambda name, shape: Q.Q4_K)
    bf16 = loaded_weights(tmp_path / "q4k.gguf", dtype="bfloat16")
    down = torch.from_numpy(np.ascontiguousarray(written["blk.0.ffn_down.weight"][1]))
    assert bf16["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(bf16["model.layers.0.mlp.down_proj.weight"], down.to(torch.bfloat16))


def assert_greedy_as_transformers(model, prompts, params, outputs, name: str) -> None:
    """Each of kvfleet's greedy outputs token for token what transformers' `model` generates."""
    with torch.inference_mode():
        for index, (prompt, p, output) in enumerate(zip(prompts, params, outputs, strict=True)):
            ids = torch.tensor([prompt])
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=p.max_tokens, eos_token_id=2, pad_token_id=0)
            assert output.token_ids == expected[0, len(prompt):].tolist(), f"{name}: prompt {index} diverged"


@pytest.mark.parametrize("name", sorted(GGUF_CONFIGS))
def test_greedy_matches_transformers_reading_the_same_gguf(tmp_path, tiny_tokenizer, name, monkeypatch):
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path / "cache"))
    hf_dir = write_checkpoint(GGUF_CONFIGS[name](), tmp_path / "hf", seed=1, tokenizer=tiny_tokenizer)
    write_gguf(hf_dir, tmp_path / "model.gguf", mixed_type)
    assert load_hf_config(str(tmp_path)).architectures  # parsed once and cached: the engine reads the cache
    prompts, params = workload(VOCAB)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, quantized_kernels=False, num_kv_blocks=256)
    assert Path(llm.engine.hf_config._name_or_path).is_relative_to(tmp_path / "cache")
    outputs = llm.generate(prompts, params, use_tqdm=False)
    # transformers' GGUF config drops head_dim (Qwen3) and Phi-3's window: give it the checkpoint's.
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf", dtype=torch.float32,
                                                 config=AutoConfig.from_pretrained(hf_dir)).eval()
    assert_greedy_as_transformers(model, prompts, params, outputs, name)


def test_a_mixtral_gguf_written_as_a_llama_with_experts_runs_as_mixtral(tmp_path, tiny_tokenizer, monkeypatch):
    """llama.cpp writes Mixtral as a `llama` with experts (stacked ffn_*_exps, llama.expert_count),
    which transformers reads as a plain Llama: kvfleet reads it as the Mixtral it is, and its F32
    file runs token-identical to transformers on the checkpoint it was written from."""
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path / "cache"))
    hf_dir = write_checkpoint(TINY_CONFIGS["mixtral"](), tmp_path / "hf", seed=1, tokenizer=tiny_tokenizer)
    write_gguf(hf_dir, tmp_path / "model.gguf")  # every tensor F32: the checkpoint's own values
    llm = LLM(str(tmp_path / "model.gguf"), skip_tokenizer_init=True, quantized_kernels=False, num_kv_blocks=256)
    config = llm.engine.hf_config
    assert config.architectures == ["MixtralForCausalLM"]
    assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (8, 2, 96)
    prompts, params = workload(VOCAB)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert_greedy_as_transformers(model, prompts, params, outputs, "mixtral")


def test_k_quants_under_tp2_match_one_device(wide_llama, tmp_path):
    write_gguf(wide_llama, tmp_path / "model.gguf",
               lambda name, shape: Q.Q6_K if "attn" in name else Q.Q4_K if "ffn" in name else Q.Q5_K)
    prompts = [workload(VOCAB)[0][i] for i in range(3, 19)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    one = LLM(str(tmp_path / "model.gguf"), skip_tokenizer_init=True, quantized_kernels=False, num_kv_blocks=128).generate(
        prompts, params, use_tqdm=False)
    llm = LLM(str(tmp_path / "model.gguf"), skip_tokenizer_init=True, quantized_kernels=False, num_kv_blocks=128, tensor_parallel_size=2)
    try:
        two = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    identical = 0
    for a, b in zip(one, two):
        close, same = close_or_identical(a.token_ids, [top5(e) for e in a.logprobs],
                                         b.token_ids, [top5(e) for e in b.logprobs])
        assert close
        identical += same
    assert identical >= 12


def test_a_moe_gguf_under_tp2_matches_one_device(tmp_path, tiny_tokenizer):
    """Qwen3-MoE's stacked experts, dequantized and split per expert, then each expert's
    intermediate features sliced over two ranks."""
    hf_dir = write_checkpoint(GGUF_CONFIGS["qwen3_moe"](), tmp_path / "hf", seed=2, tokenizer=tiny_tokenizer)
    write_gguf(hf_dir, tmp_path / "model.gguf", mixed_type)
    prompts = [workload(VOCAB)[0][i] for i in range(3, 11)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    one = LLM(str(tmp_path / "model.gguf"), skip_tokenizer_init=True, quantized_kernels=False,
              num_kv_blocks=128).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tmp_path / "model.gguf"), skip_tokenizer_init=True, num_kv_blocks=128, tensor_parallel_size=2)
    try:
        two = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for index, (a, b) in enumerate(zip(one, two)):
        close, _ = close_or_identical(a.token_ids, [top5(e) for e in a.logprobs],
                                      b.token_ids, [top5(e) for e in b.logprobs])
        assert close, f"prompt {index}: TP=2 diverges beyond a near-tie"


def test_an_unsupported_type_is_one_line_naming_it(wide_llama, tmp_path):
    write_gguf(wide_llama, tmp_path / "model.gguf", lambda name, shape: Q.IQ4_NL if "ffn_up" in name else Q.Q8_0)
    with pytest.raises(ValueError) as raised:
        LLM(str(tmp_path / "model.gguf"), skip_tokenizer_init=True, quantized_kernels=False, num_kv_blocks=8)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("GGUF tensor blk.0.ffn_up.weight: quantization type IQ4_NL is not supported")


def test_a_folder_with_two_ggufs_asks_which(wide_llama, tmp_path):
    write_gguf(wide_llama, tmp_path / "a.gguf")
    shutil.copy(tmp_path / "a.gguf", tmp_path / "b.gguf")
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\); name one of them"):
        LLM(str(tmp_path), skip_tokenizer_init=True, quantized_kernels=False, num_kv_blocks=8)
    assert LLM(str(tmp_path / "b.gguf"), skip_tokenizer_init=True, quantized_kernels=False, num_kv_blocks=8).generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].token_ids


def test_phi3_longrope_and_partial_rotary_come_back_from_a_gguf(tiny_models, tmp_path):
    """llama.cpp keeps Phi-3's longrope factors as tensors and its rotary width as
    rope.dimension_count, both of which transformers' GGUF config drops: read back, the
    F32 file runs exactly as the safetensors checkpoint, across the switch to the long factors."""
    write_gguf(tiny_models["phi3"], tmp_path / "phi3.gguf")
    prompts, params = workload(VOCAB)
    from_gguf = LLM(str(tmp_path / "phi3.gguf"), skip_tokenizer_init=True, quantized_kernels=False, num_kv_blocks=256)
    rope = from_gguf.engine.hf_config.rope_parameters
    assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == 0.5
    assert rope["original_max_position_embeddings"] == 64 and rope["long_factor"] == [1.0, 2.5, 6.0, 12.0]
    expected = LLM(tiny_models["phi3"], num_kv_blocks=256).generate(prompts, params, use_tqdm=False)
    outputs = from_gguf.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert from_gguf.engine.scheduler.num_rope_recomputes > 0


@pytest.mark.parametrize("name", ["llama", "phi3"])
def test_a_ggufs_config_is_parsed_once_then_read_from_the_cache(tmp_path, tiny_tokenizer, name, monkeypatch):
    """gguf-py's parse takes seconds on a real vocabulary: the config kvfleet derives is kept in
    KVFLEET_CACHE, equal to the parse's (Phi-3's longrope lists included), and a file changed in
    place is parsed again."""
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path / "cache"))
    hf_dir = write_checkpoint(GGUF_CONFIGS[name](), tmp_path / "hf", seed=1, tokenizer=tiny_tokenizer)
    gguf = tmp_path / "model.gguf"
    write_gguf(hf_dir, gguf, mixed_type)
    parsed, cached = load_hf_config(str(gguf)), load_hf_config(str(gguf))
    assert Path(cached._name_or_path).is_relative_to(tmp_path / "cache")
    assert without_path(cached) == without_path(parsed)
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))  # the file changed
    assert load_hf_config(str(gguf))._name_or_path != cached._name_or_path


def without_path(config) -> dict:
    return {key: value for key, value in config.to_dict().items() if key != "_name_or_path"}


def test_the_demo_ggufs_tokenizer_and_config_come_back_from_the_cache_as_parsed(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path / "cache"))
    parsed_config, parsed_tokenizer = load_hf_config("demo"), load_tokenizer("demo")
    cached_config, cached_tokenizer = load_hf_config("demo"), load_tokenizer("demo")
    for cached in (cached_config._name_or_path, cached_tokenizer.name_or_path):
        assert Path(cached).is_relative_to(tmp_path / "cache"), cached
    assert without_path(cached_config) == without_path(parsed_config)
    text = (Path(__file__).resolve().parents[2] / "engine" / "data" / "corpus.txt").read_text()[:20000]
    assert cached_tokenizer(text).input_ids == parsed_tokenizer(text).input_ids
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est la gare ?"}]
    assert cached_tokenizer.apply_chat_template(chat, add_generation_prompt=True) == \
        parsed_tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert (cached_tokenizer.all_special_ids, cached_tokenizer.eos_token_id) == \
        (parsed_tokenizer.all_special_ids, parsed_tokenizer.eos_token_id)
