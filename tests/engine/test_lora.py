"""Multi-LoRA against transformers with each adapter merged (`merge_and_unload`): eight
random PEFT adapters (ranks 4-64, different target modules, rsLoRA, a rank_pattern) and the
base model mixed in one batch, on a tiny Llama and a tiny Qwen3; with fewer slots than
adapters (evictions), under TP=2, on the Triton kernels, and on Phi-3's fused projections.
Then the prefix cache's keys, and every way an adapter can be refused."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import EIGHT, AdapterSpec, merged_model, write_adapter
from tests.tiny_models import VOCAB

NUM_PROMPTS, MAX_TOKENS = 27, 12


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """name -> [adapter folders of EIGHT] for the two architectures the parity runs on."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: [write_adapter(tiny_models[name], root / name / f"a{i}", spec, seed=100 + i, scale=0.3)
                   for i, spec in enumerate(EIGHT)] for name in ("llama", "qwen3")}


def workload(num_prompts: int = NUM_PROMPTS):
    """Prompts of 3-60 tokens; prompt i runs adapter i % 9 - 1 (-1: the base model)."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 60))] for _ in range(num_prompts)]
    return prompts, [i % 9 - 1 for i in range(num_prompts)]


def lora_requests(folders, which):
    return [None if w < 0 else LoRARequest(f"adapter-{w}", w + 1, str(folders[w])) for w in which]


def merged_references(base_dir, folders, prompts, which, max_tokens=MAX_TOKENS):
    """transformers greedy tokens and each step's top 5, with the prompt's adapter merged."""
    models, results = {}, []
    with torch.inference_mode():
        for prompt, w in zip(prompts, which):
            if w not in models:
                models[w] = merged_model(base_dir, None if w < 0 else folders[w])
            ids = torch.tensor([prompt])
            out = models[w].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=max_tokens, eos_token_id=2, pad_token_id=0, output_logits=True,
                                     return_dict_in_generate=True)
            results.append((out.sequences[0, len(prompt):].tolist(),
                            [set(step[0].topk(5).indices.tolist()) for step in out.logits]))
    return results


def assert_matches(outputs, references) -> int:
    """vLLM's close-logprobs rule per request; returns how many are token-identical."""
    identical = 0
    for index, (output, (tokens, tops)) in enumerate(zip(outputs, references)):
        ours = output.outputs[0]
        for position, (a, b) in enumerate(zip(ours.token_ids, tokens)):
            if a != b:
                engine_top = set(sorted(ours.logprobs[position], key=ours.logprobs[position].get)[-5:])
                assert a in tops[position] and b in engine_top, f"request {index} diverged at {position}"
                break
        else:
            assert len(ours.token_ids) == len(tokens), f"request {index}"
            identical += 1
    return identical


def run(llm: LLM, folders, prompts, which):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)
    return llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests(folders, which))


@pytest.fixture(scope="module")
def references(tiny_models, adapters):
    prompts, which = workload()
    return {name: merged_references(tiny_models[name], adapters[name], prompts, which) for name in adapters}


# auto on the CPU: the native attention and the native LoRA kernel; torch: the grouped matmuls.
@pytest.mark.parametrize(("name", "backend"), [("llama", "auto"), ("qwen3", "auto"), ("llama", "torch")])
def test_mixed_batch_matches_each_merged_adapter(tiny_models, adapters, references, name, backend):
    llm = LLM(tiny_models[name], dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=8,
              max_lora_rank=64, attention_backend=backend)
    layers = llm.engine.model_runner.lora.layers.values()
    assert all((layer.cpu_kernel is not None) == (backend == "auto") for layer in layers)
    prompts, which = workload()
    outputs = run(llm, adapters[name], prompts, which)
    assert assert_matches(outputs, references[name]) >= NUM_PROMPTS - 2
    base = merged_references(tiny_models[name], None, prompts, [-1] * len(prompts))
    changed = sum(out.outputs[0].token_ids != tokens for out, (tokens, _), w in zip(outputs, base, which) if w >= 0)
    assert changed >= 0.8 * sum(w >= 0 for w in which), "the adapters barely changed the output"
    stats = llm.engine.stats()
    assert stats.num_lora_loads == 8 and len(stats.resident_loras) == 8
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_more_adapters_than_slots_evicts_and_reloads(tiny_models, adapters, references):
    llm = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=2,
              max_cpu_loras=3, max_lora_rank=64, max_num_seqs=4)
    prompts, which = workload()
    assert assert_matches(run(llm, adapters["llama"], prompts, which), references["llama"]) >= NUM_PROMPTS - 2
    lora = llm.engine.model_runner.lora
    stats = llm.engine.stats()
    assert len(stats.resident_loras) == 2 and len(lora.host) <= 3
    assert stats.num_lora_loads > 8 and lora.num_disk_loads > 8  # evicted from both tiers, read again


def test_tensor_parallel_shards_the_adapters(tiny_models, adapters, references):
    llm = LLM(tiny_models["qwen3"], dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=3,
              max_lora_rank=64, tensor_parallel_size=2)
    try:
        prompts, which = workload()
        assert assert_matches(run(llm, adapters["qwen3"], prompts, which), references["qwen3"]) >= NUM_PROMPTS - 2
        stats = llm.engine.stats()  # three slots for eight adapters: each one loaded once, in arrival order
        assert stats.num_lora_loads == 8 and len(stats.resident_loras) == 3
    finally:
        llm.shutdown()


def test_triton_kernels_in_a_mixed_batch(tiny_models, adapters, references):
    llm = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=128, enable_lora=True, max_loras=4,
              max_lora_rank=64, attention_backend="triton")
    assert any(getattr(m, "kernel", None) is not None and hasattr(m, "lora_a") for m in llm.engine.model_runner.model.modules())
    prompts, which = workload()
    picked = [0, 1, 4, 12]  # the base and adapters 0, 3 and 2
    outputs = run(llm, adapters["llama"], [prompts[i] for i in picked], [which[i] for i in picked])
    assert assert_matches(outputs, [references["llama"][i] for i in picked]) >= 3


def test_phi3_fused_projections(tiny_models, tmp_path):
    spec = AdapterSpec(8, ("qkv_proj", "gate_up_proj", "o_proj"), alpha=16.0)
    folder = write_adapter(tiny_models["phi3"], tmp_path / "phi3-adapter", spec, seed=3, scale=0.3)
    prompts, _ = workload(6)
    which = [0, -1, 0, 0, -1, 0]
    expected = merged_references(tiny_models["phi3"], [folder], prompts, which)
    llm = LLM(tiny_models["phi3"], dtype="float32", num_kv_blocks=128, enable_lora=True, max_lora_rank=8)
    assert assert_matches(run(llm, [folder], prompts, which), expected) >= 5


def test_prefix_cache_keys_include_the_adapter(tiny_models, adapters):
    llm = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=128, enable_lora=True, max_loras=2,
              max_lora_rank=64)
    prompt = [random.Random(3).randrange(3, VOCAB) for _ in range(64)]
    params = SamplingParams(temperature=0, max_tokens=2)
    folders = adapters["llama"]

    def cached(w: int) -> int:
        lora = None if w < 0 else LoRARequest(f"adapter-{w}", w + 1, str(folders[w]))
        return llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert [cached(0), cached(1), cached(-1), cached(0), cached(1), cached(-1)] == [0, 0, 0, 48, 48, 48]


def bad_adapter(tmp_path: Path, good: Path, name: str, edit) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    config, tensors = json.loads((good / "adapter_config.json").read_text()), load_file(good / "adapter_model.safetensors")
    config, tensors = edit(config, tensors)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "adapter_model.safetensors")
    return folder


def _first(tensors, part):
    return next(k for k in tensors if part in k)


BAD = {
    "dora": (lambda c, t: ({**c, "use_dora": True}, t), "use_dora"),
    "modules_to_save": (lambda c, t: ({**c, "modules_to_save": ["lm_head"]}, t), "modules_to_save"),
    "embedding": (lambda c, t: (c, {**t, "base_model.model.model.embed_tokens.lora_embedding_A": t[_first(t, "lora_A")].clone()}),
                  "embed_tokens.lora_embedding_A"),
    "rank": (lambda c, t: ({**c, "r": 96}, {k: torch.cat([v] * 3, dim=0 if "lora_A" in k else 1) for k, v in t.items()}),
             "rank 96, above max_lora_rank 64"),
    "shape": (lambda c, t: (c, {k: v[:, :-1] if "lora_A" in k else v for k, v in t.items()}), "the model expects A"),
    "half": (lambda c, t: (c, {k: v for k, v in t.items() if "lora_B" not in k}), "has lora_A but no lora_B"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_adapter_fails_its_request_alone(tiny_models, adapters, tmp_path, case):
    edit, message = BAD[case]
    folder = bad_adapter(tmp_path, adapters["llama"][3], case, edit)
    llm = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=64, enable_lora=True, max_lora_rank=64)
    with pytest.raises(ValueError, match=r"prompts\[1\]: adapter 'bad'.*" + re.escape(message)):
        llm.generate([[5, 6, 7], [5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=[None, LoRARequest("bad", 1, str(folder))])
    assert not llm.engine.has_unfinished()  # nothing of the batch was queued
    good = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False,
                        lora_request=LoRARequest("good", 2, str(adapters["llama"][3])))
    assert len(good[0].outputs[0].token_ids) == 2


def test_missing_folders_and_disabled_lora_are_refused(tiny_models, tmp_path):
    llm = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=64, enable_lora=True)
    with pytest.raises(ValueError, match="is not a folder"):
        llm.generate([[5, 6]], lora_request=LoRARequest("gone", 1, str(tmp_path / "gone")), use_tqdm=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        llm.generate([[5, 6]], lora_request=LoRARequest("empty", 1, str(tmp_path / "empty")), use_tqdm=False)
    plain = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="start it with enable_lora"):
        plain.generate([[5, 6]], lora_request=LoRARequest("any", 1, str(tmp_path)), use_tqdm=False)


# Alternatives that overlap, then a class no name ends with: every split of the name is tried (each
# character more triples the work, for Python's re and the regex module alike).
BACKTRACKING_KEY = r"([\w.]|[\w.][\w.]|[\w.][\w.][\w.])+[A-Z]"


def test_a_pattern_key_built_to_backtrack_fails_its_adapter_within_the_time_bound(tiny_models, adapters, tmp_path):
    """alpha_pattern (and rank_pattern) keys are PEFT's regular expressions; one that backtracks
    without end fails its adapter, named, within the bound, and the engine goes on."""
    import time  # noqa: PLC0415

    from engine.lora.peft import PATTERN_SECONDS  # noqa: PLC0415

    keys = {"q_proj": 4, BACKTRACKING_KEY: 8}  # a plain name first: compared as text, at once
    folder = bad_adapter(tmp_path, adapters["llama"][3], "slow", lambda c, t: ({**c, "alpha_pattern": keys}, t))
    llm = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=64, enable_lora=True, max_lora_rank=64)
    started = time.monotonic()
    with pytest.raises(ValueError, match="takes too long to match module names"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=LoRARequest("slow", 1, str(folder)))
    assert time.monotonic() - started < PATTERN_SECONDS + 30  # bounded, not 2^n (a slow host's load included)
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_pattern_keys_match_module_name_ends_as_peft_does():
    from engine.lora.peft import key_matches  # noqa: PLC0415

    module = "model.layers.3.self_attn.q_proj"
    assert key_matches("q_proj", module, float("inf"), "a") and key_matches("self_attn.q_proj", module, 1e12, "a")
    assert not key_matches("_proj", module, 1e12, "a")  # whole names only, as PEFT's (.*\.)? anchor
    assert key_matches(r"layers\.[0-4]\.self_attn\.q_proj", module, 1e12, "a")  # a regular expression, as PEFT's
    assert not key_matches(r"layers\.[5-9]\.self_attn\.q_proj", module, 1e12, "a")


def test_declared_shapes_are_checked_before_any_weight_is_read(tiny_models, adapters, tmp_path, monkeypatch):
    """A rank past the maximum or a shape of another model is refused from the file's header:
    no tensor of it is read (a file of a huge rank costs no memory)."""
    from safetensors import safe_open  # noqa: PLC0415

    from engine.lora import peft  # noqa: PLC0415

    read = []

    class CountingHandle:
        def __init__(self, path, framework):
            self.handle = safe_open(path, framework=framework)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, key):
            return self.inner.get_slice(key)

        def get_tensor(self, key):
            read.append(key)
            return self.inner.get_tensor(key)

    monkeypatch.setattr(peft, "safe_open", CountingHandle)
    llm = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=64, enable_lora=True, max_lora_rank=64)
    for case in ("rank", "shape"):
        folder = bad_adapter(tmp_path, adapters["llama"][3], case, BAD[case][0])
        with pytest.raises(ValueError, match=re.escape(BAD[case][1])):
            llm.generate([[5, 6]], lora_request=LoRARequest(case, 1, str(folder)), use_tqdm=False)
    assert read == []
    llm.generate([[5, 6]], lora_request=LoRARequest("good", 2, str(adapters["llama"][3])), use_tqdm=False)
    assert read  # a good adapter's weights are read, once checked
