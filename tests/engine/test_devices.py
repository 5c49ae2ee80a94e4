"""The engine's steps keep their host tensors on the host whatever torch's default device
is: a caller (the GPU kernel tests, a notebook) may have set another one, where pinning
and the host-side index math would break. "meta" stands in for CUDA here: a host tensor
made there has no data, so any step input that follows the default fails loudly."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.devices import host_default_device, repeat_interleave
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


@pytest.mark.parametrize("values, repeats", [([3, 1, 4], [2, 0, 3]), ([7], [1]), ([], []), ([0, 1, 2, 3], [1, 1, 1, 1])])
def test_repeat_interleave_is_torchs_on_the_host(values, repeats):
    expected = torch.repeat_interleave(torch.tensor(values, dtype=torch.int64), torch.tensor(repeats, dtype=torch.int64))
    assert torch.equal(repeat_interleave(values, repeats), expected)
    got = repeat_interleave(torch.tensor(values, dtype=torch.int32), torch.tensor(repeats, dtype=torch.int64))
    assert got.dtype == torch.int32 and torch.equal(got, expected.int())
    torch.set_default_device("meta")
    try:
        assert repeat_interleave(values, repeats).device.type == "cpu"
    finally:
        torch.set_default_device(None)


def test_steps_do_not_wake_torchs_thread_pool_to_index_their_tokens(tiny_models, tmp_path, tiny_tokenizer):
    """torch.repeat_interleave opens an OpenMP region per call (grain 1): on a busy or many-core
    host that cost ~0.5-4.6 ms a step. Generation and embedding steps build their per-token
    indices without it (engine/devices.py: repeat_interleave)."""
    llm = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=64)
    embedder = LLM(str(write_embedding_checkpoint("bert", tmp_path / "bert", tiny_tokenizer)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        embeddings = embedder.embed(PROMPTS, use_tqdm=False)
    names = {event.name for event in profile.events()}
    assert [len(o.token_ids) for o in outputs] == [4, 4] and len(embeddings) == 2
    assert "aten::embedding" in names  # the profile saw the models run
    assert "aten::repeat_interleave" not in names
