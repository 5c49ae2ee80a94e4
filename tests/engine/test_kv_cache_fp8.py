"""An fp8 KV cache in the engine (kv_cache_dtype, engine/kv_quant.py): the same memory holds
twice the blocks of bf16 (four times fp32's), generations stay within a near-tie of the model's
own dtype on the parity prompts, the checkpoint's k_scale/v_scale reach every layer, computed
scales come from the first step's keys, and prefix caching, preemption, resume and tensor
parallelism run on it unchanged."""

from __future__ import annotations

import argparse
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LLMEngine, SamplingParams
from engine.arg_utils import add_engine_args, engine_config_from_args
from engine.config import EngineConfig
from tests.engine.test_parity import workload
from tests.engine.test_tensor_parallel import close_or_identical, top5
from tests.kvfleet_kernels.native import native_cpu
from tests.tiny_models import VOCAB

MEMORY = 2 * 2**20


def attention_layers(llm: LLM):
    return [m for m in llm.engine.model_runner.model.modules() if hasattr(m, "num_kv_heads")]


def assert_close_runs(ours, theirs) -> None:
    for index, (a, b) in enumerate(zip(ours, theirs)):
        close, _ = close_or_identical(a.token_ids, [top5(e) for e in a.logprobs], b.token_ids,
                                      [top5(e) for e in b.logprobs])
        assert close, f"prompt {index}: the fp8 cache's answer and the model dtype's diverge beyond a near-tie"


def parity_runs(model: str, fp8_options: dict, options: dict):
    """(fp8 LLM, peer LLM, fp8 outputs, peer outputs) on the parity workload, with logprobs."""
    prompts, params = workload(VOCAB)
    params = [SamplingParams(**{**vars(p), "logprobs": 5}) for p in params]
    base = {"skip_tokenizer_init": True, "kv_cache_memory": MEMORY}
    fp8 = LLM(model, **base, **fp8_options)
    peer = LLM(model, **base, **options)
    return fp8, peer, fp8.generate(prompts, params, use_tqdm=False), peer.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("name, options", [
    ("llama", {}),
    ("llama", {"attention_backend": "torch"}),
    pytest.param("llama", {"dtype": "bfloat16"}, marks=native_cpu),
    ("qwen3", {}),
    ("gemma3", {}),  # sliding and full pools
])
def test_an_fp8_cache_holds_more_blocks_and_answers_within_a_near_tie(tiny_models, name, options):
    fp8, plain, ours, theirs = parity_runs(tiny_models[name], {"kv_cache_dtype": "fp8", **options}, options)
    runner = fp8.engine.model_runner
    assert runner.kv_cache_groups[0].dtype == torch.float8_e4m3fn
    assert runner.bytes_per_layer_block * runner.dtype.itemsize == plain.engine.model_runner.bytes_per_layer_block
    if name == "llama":  # one pool: the blocks are the memory over a block's bytes, exactly
        assert fp8.engine.num_total_blocks == MEMORY // runner.bytes_per_block
        assert fp8.engine.num_total_blocks == runner.dtype.itemsize * plain.engine.num_total_blocks
    assert_close_runs(ours, theirs)
    assert fp8.engine.num_free_blocks == fp8.engine.num_total_blocks


@pytest.mark.parametrize("name, kv_cache_dtype", [("llama", "fp8_e5m2"), ("mixtral", "fp8"), ("gpt_oss", "fp8"),
                                                  ("gpt_oss", "fp8_e5m2")])
def test_the_native_kernels_read_an_fp8_cache_as_the_torch_reference_does(tiny_models, name, kv_cache_dtype):
    """Against the model's own dtype these random models part beyond a near-tie now and then: their
    distributions are flat (the top 5 within ~0.3 nats), e5m2 keeps 2 mantissa bits, and an MoE's
    top-k routing flips on the noise. Against the reference reading the same fp8 bytes (MoE,
    sliding windows, gpt-oss's sinks, e5m2), the native kernels must agree; real-model answers are
    checked on SmolLM2 below."""
    options = {"kv_cache_dtype": kv_cache_dtype}
    _, _, ours, theirs = parity_runs(tiny_models[name], options, {**options, "attention_backend": "torch"})
    assert_close_runs(ours, theirs)


def test_the_demo_model_answers_within_a_near_tie_from_an_fp8_cache():
    """SmolLM2-135M-Instruct on its 16 chat questions, each fp8 cache against its own dtype's."""
    from tests.engine.test_real_model import MAX_TOKENS, QUESTIONS, chat_prompts  # noqa: PLC0415

    plain = LLM("demo", num_kv_blocks=256)
    prompts = chat_prompts(plain.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)
    theirs = plain.generate(prompts, params, use_tqdm=False)
    for kv_cache_dtype in ("fp8_e4m3", "fp8_e5m2"):
        ours = LLM("demo", num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype).generate(prompts, params, use_tqdm=False)
        for question, a, b in zip(QUESTIONS, ours, theirs):
            close, _ = close_or_identical(a.token_ids, [top5(e) for e in a.logprobs], b.token_ids,
                                          [top5(e) for e in b.logprobs])
            assert close, f"{kv_cache_dtype}, {question!r}: the fp8 cache's answer and the model dtype's diverge"
        assert "Paris" in ours[0].text


def with_kv_scales(model: str, tmp_path, names: dict[str, float]) -> str:
    """A copy of a checkpoint with the given per-layer scale tensors added (name -> value, {i} the layer)."""
    folder = tmp_path / "with-scales"
    shutil.copytree(model, folder)
    tensors = load_file(folder / "model.safetensors")
    for name, value in names.items():
        for layer in range(2):
            tensors[name.format(i=layer)] = torch.tensor(value * (layer + 1), dtype=torch.float32)
    save_file(tensors, folder / "model.safetensors")
    return str(folder)


def test_the_checkpoints_kv_scales_reach_every_layer(tiny_llama, tmp_path):
    model = with_kv_scales(tiny_llama, tmp_path, {"model.layers.{i}.self_attn.k_scale": 0.02,
                                                  "model.layers.{i}.self_attn.v_scale": 0.01})
    fp8, plain, ours, theirs = parity_runs(model, {"kv_cache_dtype": "fp8"}, {})
    assert [(layer.kv_scale.k, layer.kv_scale.v) for layer in attention_layers(fp8)] == \
        [(pytest.approx(0.02), pytest.approx(0.01)), (pytest.approx(0.04), pytest.approx(0.02))]
    assert all(layer.kv_scale is None for layer in attention_layers(plain))  # read, and not needed
    assert_close_runs(ours, theirs)


def test_an_older_single_kv_scale_serves_both(tiny_llama, tmp_path):
    model = with_kv_scales(tiny_llama, tmp_path, {"model.layers.{i}.self_attn.kv_scale": 0.05})
    llm = LLM(model, skip_tokenizer_init=True, kv_cache_memory=MEMORY, kv_cache_dtype="fp8")
    assert [(layer.kv_scale.k, layer.kv_scale.v) for layer in attention_layers(llm)] == \
        [(pytest.approx(0.05), pytest.approx(0.05)), (pytest.approx(0.1), pytest.approx(0.1))]


def test_calculated_scales_are_the_first_steps_largest_keys_and_values(tiny_llama):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, kv_cache_memory=MEMORY, kv_cache_dtype="fp8",
              calculate_kv_scales=True)
    layers = attention_layers(llm)
    assert all(layer.kv_scale.calculate for layer in layers)
    backend, seen = llm.engine.model_runner.backend, []
    forward = backend.forward

    def watching(query, key, value, *args, **kwargs):
        seen.append((key.abs().max().item(), value.abs().max().item()))
        return forward(query, key, value, *args, **kwargs)

    backend.forward = watching
    prompts, params = workload(VOCAB)
    llm.generate(prompts[:4], params[:4], use_tqdm=False)
    for layer, (key_max, value_max) in zip(layers, seen):  # the first step's call of each layer
        assert not layer.kv_scale.calculate
        assert (layer.kv_scale.k, layer.kv_scale.v) == (key_max / 200, value_max / 100)


def test_prefix_caching_preemption_and_resume_run_on_an_fp8_cache(tiny_llama):
    shared = list(range(3, 35))  # two full blocks every prompt shares
    rng = random.Random(4)
    prompts = [shared + [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 20))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=5)
    tight = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=20, max_num_seqs=8, kv_cache_dtype="fp8")
    roomy = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=256, kv_cache_dtype="fp8",
                enable_prefix_caching=False)
    ours = tight.generate(prompts, params, use_tqdm=False)
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_prefix_hit_tokens > 0
    assert_close_runs(ours, roomy.generate(prompts, params, use_tqdm=False))


def test_a_resumed_request_on_an_fp8_cache_ends_within_a_near_tie(tiny_llama):
    engine = LLMEngine(EngineConfig(model=tiny_llama, skip_tokenizer_init=True, num_kv_blocks=64,
                                    kv_cache_dtype="fp8"))
    prompt, params = list(range(3, 40)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=5)

    def run(request_id, resume=None):
        engine.add_processed_request(engine.process_request(request_id, prompt, params), resume=resume)
        while True:
            for output in engine.step():
                if output.request_id == request_id and output.finished:
                    return output

    whole = run("whole")
    engine.add_processed_request(engine.process_request("cut", prompt, params))
    while (progress := engine.progress("cut")) is None or len(progress[0].token_ids) < 12:
        engine.step()
    engine.abort("cut")
    resumed = run("resumed", progress)
    assert resumed.token_ids[:len(progress[0].token_ids)] == progress[0].token_ids
    assert_close_runs([resumed.outputs[0]], [whole.outputs[0]])


def test_tensor_parallel_ranks_share_the_fp8_cache_and_its_scales(tiny_llama, tmp_path):
    model = with_kv_scales(tiny_llama, tmp_path, {"model.layers.{i}.self_attn.k_scale": 0.02,
                                                  "model.layers.{i}.self_attn.v_scale": 0.01})
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 70))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    one = LLM(model, skip_tokenizer_init=True, num_kv_blocks=128, kv_cache_dtype="fp8")
    expected = one.generate(prompts, params, use_tqdm=False)
    two = LLM(model, skip_tokenizer_init=True, num_kv_blocks=128, kv_cache_dtype="fp8", tensor_parallel_size=2)
    try:
        assert_close_runs(two.generate(prompts, params, use_tqdm=False), expected)
    finally:
        two.shutdown()


def test_the_option_is_named_as_vllm_names_it_and_a_wrong_one_is_refused():
    parser = add_engine_args(argparse.ArgumentParser())
    config = engine_config_from_args(parser.parse_args(["--model", "demo", "--kv-cache-dtype", "fp8_e5m2",
                                                        "--calculate-kv-scales"]))
    assert (config.kv_cache_dtype, config.calculate_kv_scales) == ("fp8_e5m2", True)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        EngineConfig(model="demo", kv_cache_dtype="int8")
