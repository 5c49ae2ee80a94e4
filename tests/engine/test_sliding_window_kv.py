"""Sliding-window layers keep only the blocks their window still covers: Gemma 3's local
layers in a pool of their own (the full-attention layers' pool gets the memory they do
not take), Mistral's every layer in one pool that gets the passed blocks back. Outputs
stay token-identical to transformers."""

from __future__ import annotations

import random

from engine import LLM, SamplingParams
from engine.kv_cache import sliding_pool_bound
from tests.engine.test_parity import reference_outputs
from tests.tiny_models import VOCAB


def long_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def peak_blocks_in_use(llm: LLM, prompts, params) -> tuple[list, dict[str, int]]:
    """Run generate, stepping by hand, and record the most blocks each pool held at once."""
    engine, manager = llm.engine, llm.engine.scheduler.block_manager
    pools = {"full": getattr(manager, "full", manager), "sliding": getattr(manager, "sliding", manager)}
    for index, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(index), prompt, p)
    peak, outputs = dict.fromkeys(pools, 0), {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = output
        for name, pool in pools.items():
            peak[name] = max(peak[name], pool.num_total_blocks - pool.num_free_blocks)
    return [outputs[str(i)] for i in range(len(prompts))], peak


def test_gemma3_local_layers_hold_only_their_window(tiny_models):
    # Window 48 over blocks of 16: a running sequence's local layers need at most 5 blocks.
    options = dict(max_num_seqs=4, max_num_batched_tokens=128, kv_cache_memory=2_000_000)
    llm = LLM(tiny_models["gemma3"], **options)
    runner = llm.engine.model_runner
    assert [(len(g.layers), g.sliding_window) for g in runner.kv_groups] == [(1, None), (2, 48)]
    bound = sliding_pool_bound(llm.engine.config, 48)  # 4 * (3 + 2) + 128 / 16 = 28
    per_layer = runner.bytes_per_layer_block
    one_pool = 2_000_000 // (3 * per_layer)  # what one pool read by all three layers would hold
    assert runner.kv_pools == [((2_000_000 - bound * 2 * per_layer) // per_layer, None), (bound, 48)]
    assert runner.kv_pools[0][0] > 2 * one_pool  # the global layer's pool gets the memory the local ones left

    prompts = long_prompts(5, [300, 420, 260, 380, 330, 410])
    params = [SamplingParams(temperature=0, max_tokens=30) for _ in prompts]
    outputs, peak = peak_blocks_in_use(llm, prompts, params)
    assert [o.token_ids for o in outputs] == reference_outputs(tiny_models["gemma3"], prompts, params)
    assert peak["sliding"] <= bound < peak["full"]
    assert llm.engine.scheduler.block_manager.num_released > 0
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_mistral_hands_passed_blocks_back_to_its_only_pool(tiny_models):
    """Four prompts of 150 tokens need 10 blocks each to prefill; with 24 blocks in all, the
    blocks behind each window must come back for all four to run without preemption."""
    prompts = long_prompts(6, [150, 152, 149, 151])
    params = [SamplingParams(temperature=0, max_tokens=40) for _ in prompts]
    llm = LLM(tiny_models["mistral"], num_kv_blocks=24, max_num_seqs=4)
    assert llm.engine.model_runner.kv_pools == [(24, 48)]
    outputs, peak = peak_blocks_in_use(llm, prompts, params)
    assert [o.token_ids for o in outputs] == reference_outputs(tiny_models["mistral"], prompts, params)
    assert llm.engine.scheduler.num_preemptions == 0
    assert llm.engine.scheduler.block_manager.num_released >= 4 * 6
    assert peak["full"] <= 24
