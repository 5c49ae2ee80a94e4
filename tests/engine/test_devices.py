"""The engine's steps keep their host tensors on the host whatever torch's default device
is: a caller (the GPU kernel tests, a notebook) may have set another one, where pinning
and the host-side index math would break. "meta" stands in for CUDA here: a host tensor
made there has no data, so any step input that follows the default fails loudly."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.devices import host_default_device
from tests.embedding_models import write_embedding_checkpoint

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]


@pytest.fixture
def default_device_meta():
    torch.set_default_device("meta")
    yield
    torch.set_default_device(None)


@pytest.mark.parametrize("arch, backend", [("llama", "auto"), ("gemma3", "torch"), ("qwen3_moe", "auto")])
def test_generation_ignores_the_callers_default_device(tiny_models, arch, backend, request):
    llm = LLM(tiny_models[arch], dtype="float32", num_kv_blocks=64, attention_backend=backend)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    request.getfixturevalue("default_device_meta")
    assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected
    assert torch.get_default_device().type == "meta"  # the caller's setting is left as it was


def test_embedding_ignores_the_callers_default_device(tmp_path, tiny_tokenizer, request):
    llm = LLM(str(write_embedding_checkpoint("bert", tmp_path / "bert", tiny_tokenizer)))
    expected = [o.outputs[0].embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    request.getfixturevalue("default_device_meta")
    assert [o.outputs[0].embedding for o in llm.embed(PROMPTS, use_tqdm=False)] == expected


def test_the_context_is_entered_only_when_the_default_moved():
    assert isinstance(host_default_device(), type(__import__("contextlib").nullcontext()))
    torch.set_default_device("meta")
    try:
        with host_default_device():
            assert torch.empty(1).device.type == "cpu"
        assert torch.empty(1).device.type == "meta"
    finally:
        torch.set_default_device(None)
