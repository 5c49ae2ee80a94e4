"""bf16 end to end on the CPU path, with the native prefill attention (on AMX, the paged kernel) and
with torch's flash kernel, for head sizes 64 and 128 (the tiny architectures' 16
and 32 stay on torch's kernel): greedy output keeps vLLM's check_logprobs_close rule against
transformers bf16 for fresh prompts, prompts after a cached prefix, prompts cut into chunks,
and a sliding window."""

from __future__ import annotations

import random

import pytest
from transformers import LlamaConfig, MistralConfig

from engine import LLM, SamplingParams
from engine.demo_model import write_checkpoint
from kvfleet_kernels import cpu_prefill_attention
from scripts.gpu_check import logprobs_close
from tests.engine.test_parity import bf16_reference

pytestmark = pytest.mark.skipif(not cpu_prefill_attention.available(), reason="needs a CPU with avx512_bf16")
VOCAB = 512


@pytest.fixture(scope="module")
def head64_models(tmp_path_factory, tiny_tokenizer) -> dict[str, str]:
    root = tmp_path_factory.mktemp("head64")
    common = {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "max_position_embeddings": 1024, "initializer_range": 0.1}
    configs = {"llama": LlamaConfig(num_key_value_heads=2, architectures=["LlamaForCausalLM"], **common),
               "mistral": MistralConfig(num_key_value_heads=1, sliding_window=40, architectures=["MistralForCausalLM"],
                                        **common)}
    return {name: str(write_checkpoint(config, root / name, seed=3, tokenizer=tiny_tokenizer))
            for name, config in configs.items()}


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-flash"])  # without AMX, with it
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_bf16_native_prefill_is_close_to_transformers(head64_models, name, native, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_prefill_attention, "preferred", lambda: native)
    for name_of_kernel in ("prefill_attention", "paged_prefill_attention"):  # the second on AMX
        kernel = getattr(cpu_prefill_attention, name_of_kernel)
        monkeypatch.setattr(cpu_prefill_attention, name_of_kernel,
                            lambda *a, kernel=kernel, **k: calls.append(1) or kernel(*a, **k))
    rng = random.Random(7)
    shared = [rng.randrange(3, VOCAB) for _ in range(96)]  # a cached prefix for the later prompts
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 70, 200)]
    prompts += [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 50, 150)]
    expected, expected_tops = bf16_reference(head64_models[name], prompts, 12)
    # A 64-token step budget cuts the longer prompts into chunks that attend to cached ones.
    llm = LLM(head64_models[name], dtype="bfloat16", num_kv_blocks=256, enable_prefix_caching=True,
              max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    llm.generate(prompts[3:4], params, use_tqdm=False)  # caches the shared prefix
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert bool(calls) == native, "the CPU backend took the other prefill attention"
    assert all(output.num_cached_tokens >= 96 for output in outputs[3:])  # the prefix came from the cache
    for index, (output, tokens, tops) in enumerate(zip(outputs, expected, expected_tops)):
        ours = output.outputs[0]
        close, diverged_at = logprobs_close(ours.token_ids, [set(p) for p in ours.logprobs], tokens, tops)
        assert close, f"prompt {index}: bf16 tokens parted from transformers' at {diverged_at} outside the top 5"
