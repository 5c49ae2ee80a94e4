"""Automatic prefix caching in the engine: exact block reuse, outputs identical to
caching off, eviction under memory pressure, exact hit and query counters."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.engine.test_parity import reference_outputs

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def run_one(llm: LLM, request_id: str, prompt: list[int]):
    """Add one request, step it once, return (its block table after the first step, output)."""
    engine = llm.engine
    engine.add_request(request_id, prompt, GREEDY)
    outputs = engine.step()
    table = list(engine.scheduler.running[0].block_table) if engine.scheduler.running else None
    while engine.has_unfinished():
        outputs += engine.step()
    return table, outputs[0]


def test_a_shared_prefix_reuses_the_same_block_ids(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=32)
    shared = tokens(1, 32)
    first_table, first = run_one(llm, "a", shared + tokens(2, 8))
    second_table, second = run_one(llm, "b", shared + tokens(3, 5))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32
    assert second_table[:2] == first_table[:2]
    assert second_table[2] != first_table[2]  # the partly filled block is never shared


def test_outputs_are_identical_with_caching_on_and_off(tiny_models):
    groups = [tokens(g, 40 + 16 * g) for g in range(3)]
    prompts = [groups[i % 3] + tokens(100 + i, 3 + i) for i in range(12)]
    results = {}
    for caching in (False, True):
        llm = LLM(tiny_models["qwen2"], num_kv_blocks=64, enable_prefix_caching=caching)
        outputs = []
        for start in range(0, 12, 4):  # in waves, so later waves find earlier prefixes cached
            outputs += llm.generate(prompts[start:start + 4], GREEDY, use_tqdm=False)
        results[caching] = outputs
    assert [o.token_ids for o in results[True]] == [o.token_ids for o in results[False]]
    assert sum(o.num_cached_tokens for o in results[False]) == 0
    assert sum(o.num_cached_tokens for o in results[True]) > 0


def test_eviction_under_memory_pressure_stays_correct(tiny_llama):
    pressured = LLM(tiny_llama, num_kv_blocks=10)  # 160 slots: every new prefix evicts old ones
    reference = LLM(tiny_llama, num_kv_blocks=64, enable_prefix_caching=False)
    prompts = [tokens(seed, 60) for seed in range(6)] + [tokens(0, 60), tokens(5, 60)]
    got = [pressured.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    expected = reference.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert got[6].num_cached_tokens == 0  # seed 0's blocks were evicted long ago
    assert got[7].num_cached_tokens == 48  # seed 5's were the last ones cached
    manager = pressured.engine.scheduler.block_manager
    assert len(manager.cached_blocks) <= manager.num_total_blocks


def test_hit_and_query_counters_are_exact(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=32)
    base = tokens(7, 50)
    run_one(llm, "1", base)  # 50 queried, nothing cached yet
    run_one(llm, "2", base[:48] + tokens(8, 10))  # 58 queried, 3 full blocks hit
    run_one(llm, "3", base)  # 50 queried; (50 - 1) // 16 = 3 blocks may hit
    stats = llm.engine.stats()
    assert stats.num_prefix_queried_tokens == 50 + 58 + 50
    assert stats.num_prefix_hit_tokens == 48 + 48


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "phi3"])
def test_shared_prefixes_match_transformers(tiny_models, name):
    """Prefixes of 40 and 48 tokens (the tiny Gemma 3's window is 48), each continued by
    short prompts and by prompts past 64 tokens: for the tiny Phi-3 the first run on the
    short RoPE factors and the others on the long ones, so they must never share blocks."""
    shared = [tokens(7, 40), tokens(8, 48)]
    prompts = [shared[(i // 2) % 2] + tokens(200 + i, 3 + i if i % 2 == 0 else 28 + i) for i in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=12) for _ in prompts]
    llm = LLM(tiny_models[name], num_kv_blocks=128)
    outputs = []
    for start in range(0, 12, 4):  # in waves, so later waves find earlier prefixes cached
        outputs += llm.generate(prompts[start:start + 4], params[start:start + 4], use_tqdm=False)
    expected = reference_outputs(tiny_models[name], prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.num_cached_tokens for o in outputs) >= 8 * 32  # later waves hit at least two blocks each


def test_a_half_written_block_is_never_served_as_a_cached_prefix(tiny_llama):
    """A's first chunk ends inside its third block, and A is aborted there (as a client
    disconnect or a preemption would stop it). B, the same prompt, may reuse only A's two
    full blocks: the third was half written."""
    prompt = tokens(11, 100)
    expected = LLM(tiny_llama, num_kv_blocks=64, enable_prefix_caching=False).generate(
        [prompt], GREEDY, use_tqdm=False)[0].token_ids
    llm = LLM(tiny_llama, num_kv_blocks=64, max_num_batched_tokens=40)
    engine = llm.engine
    engine.add_request("a", prompt, GREEDY)
    engine.step()  # A: tokens 0-39 computed; block 2 (tokens 32-47) half written
    engine.abort("a")
    b = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert b.num_cached_tokens == 32
    assert b.token_ids == expected


def test_requests_arriving_together_prefill_their_shared_prefix_once(tiny_llama):
    """Eight requests on one 64-token document, added at once: the first computes the
    document, the other seven wait a step and find it cached (not eight prefills of it side
    by side), with the same tokens as without caching."""
    document = tokens(11, 64)
    prompts = [document + tokens(300 + i, 5) for i in range(8)]
    llm = LLM(tiny_llama, num_kv_blocks=64)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [0] + [64] * 7
    stats = llm.engine.stats()
    assert stats.num_prefix_hit_tokens == 7 * 64 and stats.num_prefix_queried_tokens == 8 * 69
    reference = LLM(tiny_llama, num_kv_blocks=64, enable_prefix_caching=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference.generate(prompts, GREEDY, use_tqdm=False)]
