"""n > 1: samples share the prompt's blocks by ref count, copy the partly filled one
on write, are reproducible with a seed, and free everything when done."""

from __future__ import annotations

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.sampler import SamplerOutput
from engine.scheduler import Scheduler
from engine.sequence import Sequence


def test_fork_shares_prompt_blocks_and_copies_the_partial_one_on_write():
    scheduler = Scheduler(EngineConfig(model="unused", block_size=4, enable_prefix_caching=False), 16)
    parent = Sequence("r", list(range(10)), SamplingParams(n=3))  # blocks: 4 + 4 + 2 (partial)
    scheduler.add(parent)
    batch = scheduler.schedule()
    children = batch.forks[parent.seq_id]
    assert [c.sample_index for c in children] == [1, 2]
    assert parent.block_table == [0, 1, 2] and all(c.block_table == [0, 1, 2] for c in children)
    assert [scheduler.block_manager.blocks[i].ref_count for i in (0, 1, 2)] == [3, 3, 3]
    # Each sample draws its own first token from the parent's logits; the second one stops at once.
    finished = scheduler.postprocess(batch, [parent, *children], SamplerOutput([7, 8, 9], [None] * 3),
                                     check_stop=lambda seq: "stop" if seq is children[1] else None)
    assert finished == [children[1]] and children[1].finish_reason == "stop"
    assert all(c.num_computed_tokens == 10 for c in children)
    assert [s.output_token_ids for s in (parent, *children)] == [[7], [8], [9]]
    assert [scheduler.block_manager.blocks[i].ref_count for i in (0, 1, 2)] == [2, 2, 2]
    batch = scheduler.schedule()
    assert [s.sample_index for s in batch.seqs] == [0, 1] and batch.num_new_tokens == [1, 1]
    # The first writer into the shared partial block 2 gets a copy; the last one keeps it.
    assert batch.block_copies == [(0, 2, 3)]  # (KV pool, source, destination)
    assert [s.block_table for s in batch.seqs] == [[0, 1, 3], [0, 1, 2]]
    assert [scheduler.block_manager.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    for seq in batch.seqs:
        scheduler.finish(seq, "stop")
    assert scheduler.block_manager.num_free_blocks == 16


def test_seeded_samples_are_reproducible_distinct_and_leak_nothing(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12)
    first = llm.generate([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]], params,
                         use_tqdm=False)[0]
    again = llm.generate([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]], params,
                         use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    assert not llm.engine.requests


def test_greedy_samples_equal_the_single_greedy_completion(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64)
    prompt = list(range(40, 77))
    single = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    many = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert [c.token_ids for c in many.outputs] == [single.token_ids] * 3
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_parallel_samples_survive_preemption(tiny_llama):
    roomy = LLM(tiny_llama, num_kv_blocks=128)
    tight = LLM(tiny_llama, num_kv_blocks=12)
    prompts = [list(range(10, 10 + n)) for n in (20, 35, 50)]
    params = SamplingParams(n=2, temperature=0, max_tokens=24)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.num_free_blocks == tight.engine.num_total_blocks


def test_seeded_samples_survive_preemption_token_for_token(tiny_llama):
    """Each token's draw is keyed to (seed, sample, position) (engine/sampler.py: token_seed),
    so a sequence preempted and recomputed draws exactly what an uninterrupted one does."""
    roomy = LLM(tiny_llama, num_kv_blocks=128)
    tight = LLM(tiny_llama, num_kv_blocks=12)
    prompts = [list(range(10, 10 + n)) for n in (20, 35, 50)]
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.scheduler.num_recomputed_tokens > 0 == roomy.engine.scheduler.num_recomputed_tokens
    assert got == expected
    assert all(len(set(map(tuple, samples))) == 2 for samples in expected)


def test_token_seed_depends_on_seed_sample_and_position_alone():
    from engine.sampler import token_seed  # noqa: PLC0415

    seeds = {token_seed(seed, sample, position) for seed in (0, 1, 2**62) for sample in (0, 1) for position in range(50)}
    assert len(seeds) == 300 and all(0 <= s < 2**63 for s in seeds)
    assert token_seed(7, 1, 3) == token_seed(7, 1, 3)
