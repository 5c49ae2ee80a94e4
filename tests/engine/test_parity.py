"""The correctness oracle: greedy fp32 output is token-identical to transformers
`generate`, per prompt, for every supported architecture, including runs that
force preemption, chunked prefill and a small block size; bf16 output keeps vLLM's
check_logprobs_close rule against transformers bf16."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from scripts.gpu_check import logprobs_close

# 22 prompts: around block edges, around the tiny Gemma 3 / Mistral / gpt-oss window (48) and the tiny
# Phi-3's longrope switch (64 tokens: some prompts cross it while they generate), and long.
PROMPT_LENGTHS = [1, 2, 5, 15, 16, 17, 31, 32, 33, 47, 48, 49, 60, 64, 65, 100, 127, 150, 180, 199, 200, 230]
MAX_TOKENS = [64, 1, 8, 64, 33, 16, 64, 2, 40, 30, 64, 20, 12, 64, 9, 17, 64, 5, 64, 48, 64, 40]


def workload(vocab_size: int):
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    return prompts, [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]


def reference_outputs(model_dir: str, prompts, params) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt, p in zip(prompts, params):
            ids = torch.tensor([prompt])
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=p.max_tokens, eos_token_id=2, pad_token_id=0)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(scope="module")
def references(tiny_models):
    cache = {}

    def get(name):
        if name not in cache:
            prompts, params = workload(512)
            cache[name] = reference_outputs(tiny_models[name], prompts, params)
        return cache[name]

    return get


def assert_token_identical(llm: LLM, expected: list[list[int]]):
    prompts, params = workload(512)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for index, (output, reference) in enumerate(zip(outputs, expected)):
        assert output.prompt_token_ids == prompts[index]
        assert output.token_ids == reference, f"prompt {index} (length {len(prompts[index])}) diverged"
        expected_reason = "stop" if reference and reference[-1] == 2 else "length"
        assert output.finish_reason == expected_reason
    engine = llm.engine
    assert engine.num_free_blocks == engine.num_total_blocks, "blocks leaked after generate"


# The CPU default (native decode kernel, packed linears: PackedBf16Linear for bf16 on CPUs with native bf16, else oneDNN)
# and the plain torch path.
CPU_PATHS = {"default": {"attention_backend": "cpu", "onednn_linear": True},
             "plain-torch": {"attention_backend": "torch", "onednn_linear": False}}


def check_cpu_path(llm: LLM, path: str) -> None:
    runner = llm.engine.model_runner
    assert runner.backend.name == CPU_PATHS[path]["attention_backend"]
    kinds = {type(m).__name__ for m in runner.model.modules()}
    assert bool(kinds & {"OneDNNLinear", "PackedBf16Linear"}) == CPU_PATHS[path]["onednn_linear"]
    assert ("Linear" in kinds) != CPU_PATHS[path]["onednn_linear"]


ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "opt", "mixtral", "qwen3_moe", "gpt_oss"]


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_matches_transformers(tiny_models, references, name, path):
    llm = LLM(tiny_models[name], num_kv_blocks=512, **CPU_PATHS[path])
    check_cpu_path(llm, path)
    assert_token_identical(llm, references(name))
    assert llm.engine.scheduler.num_preemptions == 0
    if name == "phi3":  # each sequence that grew past the pretraining length (64) was recomputed once
        lengths = [len(p) for p in workload(512)[0]]
        crossed = sum(n <= 64 < n + len(ref) - 1 for n, ref in zip(lengths, references(name)))
        assert crossed >= 5 and llm.engine.scheduler.num_rope_recomputes == crossed


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "phi3", "opt", "mixtral", "qwen3_moe", "gpt_oss"])
def test_greedy_matches_transformers_under_preemption(tiny_models, references, name, path):
    # The longest request needs ceil((230 + 40) / 16) = 17 blocks; 24 cannot hold the batch.
    llm = LLM(tiny_models[name], num_kv_blocks=24, **CPU_PATHS[path])
    assert_token_identical(llm, references(name))
    assert llm.engine.scheduler.num_preemptions > 0


def test_greedy_matches_transformers_with_chunked_prefill_and_small_blocks(tiny_models, references):
    llm = LLM(tiny_models["mistral"], num_kv_blocks=256, block_size=8, max_num_batched_tokens=24)
    assert_token_identical(llm, references("mistral"))


def bf16_reference(model_dir: str, prompts: list[list[int]], num_tokens: int):
    """transformers bf16 greedy tokens and each step's top-5 candidates."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    tokens, tops = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=num_tokens,
                                 min_new_tokens=num_tokens, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            tops.append([set(step[0].float().topk(5).indices.tolist()) for step in out.logits])
    return tokens, tops


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_bf16_greedy_is_close_to_transformers_bf16(tiny_models, name):
    """bf16 on the CPU default path (packed bf16 linears: the brgemm microkernel on AMX CPUs, the
    vnni kernel on avx512_bf16 ones, else oneDNN; bf16 KV cache and decode kernel, flash prefill) under vLLM's check_logprobs_close rule: bf16 rounding differs between
    implementations, so tokens may part where two candidates are near-tied, but only there."""
    prompts = [p for p, n in zip(workload(512)[0], PROMPT_LENGTHS) if n in (5, 17, 33, 49, 65, 127, 200)]
    expected, expected_tops = bf16_reference(tiny_models[name], prompts, 16)
    llm = LLM(tiny_models[name], dtype="bfloat16", num_kv_blocks=512, **CPU_PATHS["default"])
    assert llm.engine.model_runner.kv_caches[0][0].dtype == torch.bfloat16
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5),
                           use_tqdm=False)
    for index, (output, tokens, tops) in enumerate(zip(outputs, expected, expected_tops)):
        close, diverged_at = logprobs_close(output.token_ids, [set(p) for p in output.logprobs], tokens, tops)
        assert close, f"prompt {index}: bf16 tokens parted from transformers' at {diverged_at} outside the top 5"
