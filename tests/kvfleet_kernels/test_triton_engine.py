"""attention_backend="triton" end to end (interpreter on the CPU): the same greedy
tokens as the torch backend, with preemption and with a cached prefix."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.attention import select_backend

PROMPT_LENGTHS = [1, 7, 16, 17, 33, 48, 64, 90]


def prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]


def greedy(max_tokens=10):
    return SamplingParams(temperature=0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def torch_outputs(tiny_models):
    llm = LLM(tiny_models["llama"], num_kv_blocks=128)
    return [o.token_ids for o in llm.generate(prompts(), greedy(), use_tqdm=False)]


def test_triton_backend_matches_torch(tiny_models, torch_outputs):
    llm = LLM(tiny_models["llama"], num_kv_blocks=128, attention_backend="triton")
    assert llm.engine.model_runner.backend.name == "triton"
    assert [o.token_ids for o in llm.generate(prompts(), greedy(), use_tqdm=False)] == torch_outputs


def test_triton_backend_matches_torch_under_preemption(tiny_models):
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_models["llama"], num_kv_blocks=12, attention_backend=backend)
        outputs[backend] = [o.token_ids for o in llm.generate(prompts(), greedy(24), use_tqdm=False)]
        assert llm.engine.scheduler.num_preemptions > 0
    assert outputs["triton"] == outputs["torch"]


def test_triton_backend_reads_a_cached_prefix(tiny_models):
    shared = prompts()[-1][:64]  # four full blocks
    requests = [shared + [5, 6, 7], shared + [9, 10]]
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_models["mistral"], num_kv_blocks=64, attention_backend=backend)
        first = llm.generate([requests[0]], greedy(), use_tqdm=False)[0]
        second = llm.generate([requests[1]], greedy(), use_tqdm=False)[0]
        assert first.num_cached_tokens == 0 and second.num_cached_tokens == 64
        results[backend] = (first.token_ids, second.token_ids)
    assert results["triton"] == results["torch"]


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    import torch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device; on the CPU it runs only under TRITON_INTERPRET=1"):
        select_backend("triton", torch.device("cpu"))
