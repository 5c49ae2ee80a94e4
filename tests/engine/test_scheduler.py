"""Scheduler policy on exact numbers: budget, admission by free blocks, preemption."""

from engine.config import EngineConfig
from engine.sampler import SamplerOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def make_scheduler(num_blocks, **options) -> Scheduler:
    options.setdefault("enable_prefix_caching", False)
    return Scheduler(EngineConfig(model="unused", block_size=4, **options), num_blocks)


def run_step(scheduler: Scheduler):
    """Pretend the model ran: every sequence whose tokens all ran this step samples token 0."""
    batch = scheduler.schedule()
    sampled = [s for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens]
    scheduler.postprocess(batch, sampled, SamplerOutput([0] * len(sampled), [None] * len(sampled)),
                          check_stop=lambda seq: None)
    return batch


def test_token_budget_splits_a_long_prompt_into_chunks_and_keeps_decodes_running():
    scheduler = make_scheduler(32, max_num_batched_tokens=8)
    short = Sequence("short", [1, 2, 3], SamplingParams())
    long = Sequence("long", list(range(20)), SamplingParams())
    scheduler.add(short)
    scheduler.add(long)
    batch = run_step(scheduler)
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [("short", 3), ("long", 5)]
    batch = run_step(scheduler)  # short decodes one token while long gets the rest of the budget
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [("short", 1), ("long", 7)]
    batch = run_step(scheduler)
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [("short", 1), ("long", 7)]
    assert long.num_computed_tokens == 19 and long.num_tokens == 20
    batch = run_step(scheduler)
    assert batch.num_new_tokens == [1, 1]
    assert long.num_tokens == 21  # its last prompt token ran alone and produced the first output


def test_without_chunking_a_prompt_over_the_budget_waits():
    scheduler = make_scheduler(32, max_num_batched_tokens=8, enable_chunked_prefill=False)
    scheduler.add(Sequence("a", list(range(6)), SamplingParams()))
    scheduler.add(Sequence("b", list(range(6)), SamplingParams()))
    batch = scheduler.schedule()
    assert [s.request_id for s in batch.seqs] == ["a"]


def test_admission_needs_free_blocks_and_respects_max_num_seqs():
    scheduler = make_scheduler(4, max_num_seqs=2)
    for name in "abc":
        scheduler.add(Sequence(name, list(range(6)), SamplingParams()))  # 2 blocks each
    batch = scheduler.schedule()
    assert [s.request_id for s in batch.seqs] == ["a", "b"]
    assert scheduler.block_manager.num_free_blocks == 0
    assert [s.request_id for s in scheduler.waiting] == ["c"]


def test_a_running_sequence_without_a_block_preempts_the_newest():
    scheduler = make_scheduler(4)
    a = Sequence("a", list(range(8)), SamplingParams())  # exactly 2 blocks
    b = Sequence("b", list(range(8)), SamplingParams())
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)  # both prefilled, each sampled a 9th token: both now need a 3rd block
    assert a.num_tokens == 9 and scheduler.block_manager.num_free_blocks == 0
    batch = run_step(scheduler)
    assert [s.request_id for s in batch.seqs] == ["a"]
    assert scheduler.num_preemptions == 1
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert list(scheduler.waiting) == [b]
    assert a.block_table == [0, 1, 3]


def test_finish_and_abort_return_every_block():
    scheduler = make_scheduler(8)
    a = Sequence("a", list(range(5)), SamplingParams())
    b = Sequence("b", list(range(5)), SamplingParams())
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    scheduler.finish(a, "stop")
    assert a.finish_reason == "stop" and a.block_table == []
    assert [s.request_id for s in scheduler.abort("b")] == ["b"]
    assert b.finish_reason == "abort"
    assert scheduler.block_manager.num_free_blocks == 8
    assert not scheduler.has_unfinished()


def test_a_prompt_whose_prefix_a_running_prefill_computes_waits_for_it_to_be_cached():
    scheduler = make_scheduler(32, max_num_batched_tokens=32, enable_prefix_caching=True)
    first = Sequence("first", list(range(12)), SamplingParams())
    sharing = Sequence("sharing", list(range(8)) + list(range(100, 108)), SamplingParams())  # first 2 blocks shared
    other = Sequence("other", list(range(200, 208)), SamplingParams())
    for seq in (first, sharing, other):
        scheduler.add(seq)
    batch = run_step(scheduler)  # "sharing" would compute blocks 0 and 1 beside "first": it waits
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [("first", 12), ("other", 8)]
    assert [s.request_id for s in scheduler.waiting] == ["sharing"]
    batch = run_step(scheduler)  # now they are cached: it computes only its own 8 tokens
    assert [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)] == [
        ("first", 1), ("other", 1), ("sharing", 8)]
    assert sharing.num_cached_tokens == 8
    assert sharing.block_table[:2] == first.block_table[:2]


def test_without_prefix_caching_nothing_waits_for_a_running_prefill():
    scheduler = make_scheduler(32, max_num_batched_tokens=32)
    for name in "ab":
        scheduler.add(Sequence(name, list(range(12)), SamplingParams()))
    assert [s.request_id for s in run_step(scheduler).seqs] == ["a", "b"]
