"""The admission rule on the engine's own numbers."""

from engine import LLM, EngineStats, SamplingParams
from workers.admission import Admission


def stats(**numbers) -> EngineStats:
    base = dict(num_running=0, num_waiting=0, num_unstarted=0, num_unstarted_blocks_needed=0, num_free_blocks=40,
                num_total_blocks=40, num_live_tokens=0, num_used_slots=0, num_preemptions=0, num_recomputed_tokens=0,
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
    assert Admission(max_num_seqs=8).fit(stats(num_free_blocks=10, num_running=2), [3, 4, 2, 1]) == 2  # spare 8: 3 + 4
    assert Admission(max_num_seqs=8).fit(stats(num_free_blocks=10), [11]) == 0
    assert Admission(max_num_seqs=8).fit(stats(num_free_blocks=10), []) == 0


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


def test_batch_work_leaves_the_online_reserve_free():
    admission = Admission(max_num_seqs=8, initial_blocks_per_request=4, online_reserve=2)
    # Seats: 8 - 3 running - 2 reserved = 3. Blocks: 40 free - 3 growth - 2 x 4 online = 29 -> 7 requests.
    assert admission.count(stats(num_running=3)) == 3
    # Blocks bind: 20 free - 3 growth - 8 reserved = 9 spare -> 2 requests of 4 blocks.
    assert admission.count(stats(num_running=3, num_free_blocks=20)) == 2
    assert admission.fit(stats(num_running=3, num_free_blocks=20), [4, 4, 2]) == 2  # 9 spare: 4 + 4
    assert admission.count(stats(num_running=6)) == 0  # the last two seats are online's


def test_an_idle_worker_does_not_keep_blocks_back():
    """Any request the pool can hold must start somewhere: with nothing running, batch
    work may take every block (an online request would preempt it)."""
    admission = Admission(max_num_seqs=8, initial_blocks_per_request=8, online_reserve=2)
    assert admission.fit(stats(num_free_blocks=40), [39]) == 1
    assert admission.fit(stats(num_free_blocks=40, num_running=1), [39]) == 0


def test_the_online_lane_pulls_until_a_pulled_request_has_not_started():
    admission = Admission(max_num_seqs=8, online_reserve=2)
    assert admission.online_count(num_online=0, num_online_unstarted=0) == 8  # batch load does not matter
    assert admission.online_count(num_online=5, num_online_unstarted=0) == 3
    assert admission.online_count(num_online=5, num_online_unstarted=1) == 0  # full: leave it to other workers


def test_the_reserve_follows_the_online_requests_seen():
    admission = Admission(max_num_seqs=8, initial_blocks_per_request=8, smoothing=0.5, online_reserve=1)
    admission.observe_online(2)
    assert (admission.online_blocks_per_request, admission.blocks_per_request) == (5, 8)
    assert admission.spare_blocks(stats(num_running=1, num_free_blocks=20)) == 20 - 1 - 5
