"""The admission rule on the engine's own numbers."""

from engine import LLM, EngineStats, SamplingParams
from workers.admission import Admission


def stats(**numbers) -> EngineStats:
    base = dict(num_running=0, num_waiting=0, num_unstarted=0, num_unstarted_blocks_needed=0, num_free_blocks=40,
                num_total_blocks=40, num_live_tokens=0, num_used_slots=0, num_preemptions=0,
                num_prefix_queried_tokens=0, num_prefix_hit_tokens=0)
    return EngineStats(**{**base, **numbers})


def test_pulls_what_free_blocks_admit_minus_a_growth_reserve():
    admission = Admission(max_num_seqs=8, initial_blocks_per_request=4)
    assert admission.count(stats()) == 8  # min(8 seats, 40 // 4 = 10)
    assert admission.count(stats(num_running=3, num_free_blocks=23)) == 5  # (23 - 3) // 4
    assert admission.count(stats(num_running=7, num_free_blocks=30)) == 1  # one seat left
    assert admission.count(stats(num_running=8)) == 0
    assert admission.count(stats(num_free_blocks=3)) == 0


def test_never_pulls_while_a_request_waits_in_the_engine():
    admission = Admission(max_num_seqs=8, initial_blocks_per_request=1)
    assert admission.count(stats(num_waiting=1, num_unstarted=1)) == 0
    assert admission.count(stats(num_waiting=1)) == 0  # a preempted one waits too


def test_estimate_follows_observed_requests():
    admission = Admission(max_num_seqs=8, initial_blocks_per_request=8, smoothing=0.5)
    admission.observe(2)
    assert admission.blocks_per_request == 5
    admission.observe(1)
    assert admission.blocks_per_request == 3
    assert admission.count(stats(num_free_blocks=30)) == 8  # min(8, 30 // 3)


def test_fit_keeps_the_prefix_that_fits_and_hands_back_the_rest():
    assert Admission.fit(stats(num_free_blocks=10, num_running=2), [3, 4, 2, 1]) == 2  # spare 8: 3 + 4
    assert Admission.fit(stats(num_free_blocks=10), [11]) == 0
    assert Admission.fit(stats(num_free_blocks=10), []) == 0


def test_on_the_engines_numbers(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=20, max_num_seqs=4)
    engine = llm.engine
    engine.add_request("a", [5] * 40, SamplingParams(max_tokens=4))  # 3 blocks to start
    engine.step()
    numbers = engine.stats()
    assert (numbers.num_running, numbers.num_free_blocks, numbers.num_waiting) == (1, 17, 0)
    admission = Admission(max_num_seqs=4, initial_blocks_per_request=engine.num_blocks_needed(40))
    assert admission.blocks_per_request == 3
    assert admission.count(numbers) == 3  # min(3 seats, (17 - 1) // 3 = 5)
