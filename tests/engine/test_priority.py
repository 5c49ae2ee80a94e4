"""Priority scheduling on exact numbers: (priority, arrival) order, and higher-priority
work taking seats and blocks from lower-priority running work."""

from engine import LLM, RequestOutputKind, SamplingParams
from engine.sequence import Sequence, SequenceStatus
from tests.engine.test_scheduler import make_scheduler, run_step


def seq(name: str, num_tokens: int, priority: int, arrival: float) -> Sequence:
    return Sequence(name, list(range(num_tokens)), SamplingParams(), arrival_time=arrival, priority=priority)


def test_waiting_runs_by_priority_then_arrival():
    scheduler = make_scheduler(32, max_num_seqs=3)
    for s in (seq("late-batch", 4, 10, 1.0), seq("early-batch", 4, 10, 0.0), seq("online", 4, 0, 2.0),
              seq("urgent", 4, -5, 3.0)):
        scheduler.add(s)
    batch = scheduler.schedule()
    assert [s.request_id for s in batch.seqs] == ["urgent", "online", "early-batch"]
    assert [s.request_id for s in scheduler.waiting] == ["late-batch"]


def test_higher_priority_takes_the_seat_of_the_lowest_priority_newest():
    scheduler = make_scheduler(32, max_num_seqs=2)
    old, new = seq("batch-old", 4, 10, 0.0), seq("batch-new", 4, 10, 1.0)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)
    online = seq("online", 4, 0, 2.0)
    scheduler.add(online)
    batch = run_step(scheduler)
    assert [s.request_id for s in batch.seqs] == ["batch-old", "online"]
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and scheduler.num_preemptions == 1
    assert [s.request_id for s in scheduler.running] == ["online", "batch-old"]  # running in priority order


def test_higher_priority_takes_blocks_and_equal_priority_never_preempts():
    scheduler = make_scheduler(6, max_num_seqs=8)  # 6 blocks of 4 tokens
    a, b = seq("a", 8, 10, 0.0), seq("b", 8, 10, 1.0)  # 2 blocks each, +1 to grow
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)
    assert scheduler.block_manager.num_free_blocks == 2
    same = seq("same-priority", 8, 10, 2.0)  # needs 2 blocks, 2 free minus 2 kept for growth: waits
    scheduler.add(same)
    run_step(scheduler)
    assert scheduler.num_preemptions == 0 and same.status is SequenceStatus.WAITING
    online = seq("online", 8, 0, 3.0)
    scheduler.add(online)
    batch = run_step(scheduler)
    assert scheduler.num_preemptions == 1 and b.status is SequenceStatus.WAITING  # b: lowest priority, newest
    assert [s.request_id for s in batch.seqs] == ["a", "online"]
    assert [s.request_id for s in scheduler.waiting] == ["b", "same-priority"]  # by arrival


def test_engine_runs_online_before_a_batch_backlog(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64, max_num_seqs=2)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for index in range(4):
        engine.add_request(f"batch-{index}", [5, 6, 7, 8], params, priority=100)
    engine.step()
    engine.add_request("online", [5, 6, 7, 9], SamplingParams(temperature=0, max_tokens=2,
                                                              output_kind=RequestOutputKind.FINAL_ONLY))
    finished = []
    while engine.has_unfinished():
        finished += [output.request_id for output in engine.step()]
    assert finished[0] == "online"
    assert sorted(finished) == ["batch-0", "batch-1", "batch-2", "batch-3", "online"]
