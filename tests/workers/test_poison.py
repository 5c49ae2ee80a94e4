"""One request never fails the requests beside it: a request that breaks an engine step gets
its own error line and its neighbours complete; a line that breaks while it is turned into
engine work gets its own error line with a code; a step that fails for every request alike
hands the work back uncounted, never into the dead letters."""

from __future__ import annotations

import threading
import time

import pytest

from engine import EngineConfig, LLMEngine
from jobs import batches, keys, online
from tests.engine.test_isolation import POISON_SEED, PoisonedSampler
from tests.workers.helpers import MODEL, completion, make_worker, read_lines, run_until, submit_lines
from workers.worker import MAX_FAILED_STEPS


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=96, max_num_seqs=16))


def num_dead_letters(r) -> int:
    return sum(r.xlen(key) for key in r.scan_iter(match=keys.DEAD_LETTERS_PATTERN))


def sampled(prompt: str, seed: int, **fields) -> dict:
    return {"custom_id": prompt, "prompt": prompt, "max_tokens": 6, "temperature": 0.7, "seed": seed, **fields}


def test_one_poisoned_request_among_fifty_of_two_tenants_fails_alone(engine, r, monkeypatch):
    worker = make_worker(engine, r)
    acme = submit_lines(r, [sampled(f"acme {i}", i) for i in range(25)], tenant="acme")
    globex = submit_lines(r, [sampled(f"globex {i}", 100 + i) for i in range(24)]
                          + [sampled("globex poison", POISON_SEED)], tenant="globex")
    done = run_until(worker, r, [acme, globex], timeout=120)
    expected = {line["custom_id"]: line["response"]["body"]["choices"][0]["text"]
                for batch_id in (acme, globex) for line in read_lines(r, done[batch_id]["output_file_id"])}
    r.flushall()  # the same work again, with the poisoned request breaking every step it is in

    sampler = engine.model_runner.sampler
    monkeypatch.setattr(engine.model_runner, "sampler",
                        PoisonedSampler(sampler, lambda row: row.params.seed == POISON_SEED))
    worker = make_worker(engine, r)
    acme = submit_lines(r, [sampled(f"acme {i}", i) for i in range(25)], tenant="acme")
    globex = submit_lines(r, [sampled(f"globex {i}", 100 + i) for i in range(24)]
                          + [sampled("globex poison", POISON_SEED)], tenant="globex")
    done = run_until(worker, r, [acme, globex], timeout=120)
    assert done[acme]["request_counts"] == {"total": 25, "completed": 25, "failed": 0}
    assert done[globex]["request_counts"] == {"total": 25, "completed": 24, "failed": 1}
    [error] = read_lines(r, done[globex]["error_file_id"])
    assert error["custom_id"] == "globex poison" and error["error"]["code"] == "engine_error"
    assert "OverflowError" in error["error"]["message"]
    outputs = {line["custom_id"]: line["response"]["body"]["choices"][0]["text"]
               for batch_id in (acme, globex) for line in read_lines(r, done[batch_id]["output_file_id"])}
    assert outputs == {custom_id: text for custom_id, text in expected.items() if custom_id != "globex poison"}
    assert num_dead_letters(r) == 0
    assert worker.metrics.failed_requests._value.get() == 1 and worker.metrics.failed_steps._value.get() == 0


@pytest.mark.parametrize("error, code", [(TypeError("unexpected keyword"), "invalid_request"),
                                         (RuntimeError("tokenizer crashed"), "request_failed")])
def test_a_line_that_breaks_while_it_becomes_engine_work_gets_its_own_error_line(engine, r, monkeypatch, error,
                                                                                code):
    encode = engine.tokenizer.encode

    def breaking_encode(text, *args, **kwargs):
        if text == "breaks":
            raise error
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", breaking_encode)
    worker = make_worker(engine, r)
    batch_id = submit_lines(r, [completion("ok", "fine"), completion("bad", "breaks"),
                                {"custom_id": "echo", "method": "POST", "url": "/v1/completions",
                                 "body": {"prompt": "no echo", "max_tokens": 4, "echo": False}}])
    done = run_until(worker, r, [batch_id], timeout=60)[batch_id]
    assert done["status"] == "completed"  # at once: nothing waits for the batch to expire
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    [line] = read_lines(r, done["error_file_id"])
    assert line["custom_id"] == "bad" and line["error"]["code"] == code
    assert f"{type(error).__name__}: {error}" in line["error"]["message"]
    assert num_dead_letters(r) == 0


def test_a_step_failing_for_every_request_hands_them_back_uncounted(engine, r, monkeypatch):
    sampler = engine.model_runner.sampler
    broken = PoisonedSampler(sampler, lambda row: True)
    monkeypatch.setattr(engine.model_runner, "sampler", broken)
    worker = make_worker(engine, r, max_deliveries=1)
    batch_id = submit_lines(r, [completion(f"c{i}", f"request {i}") for i in range(4)])
    guard = threading.Timer(60, worker.request_stop)  # a worker that never gives up drains and returns 0
    guard.start()
    try:
        assert worker.work() == 1  # MAX_FAILED_STEPS in a row: it exits for a restart, its work handed back
    finally:
        guard.cancel()
    assert worker.metrics.failed_steps._value.get() == MAX_FAILED_STEPS
    assert num_dead_letters(r) == 0 and batches.num_counted(r, batch_id) == 0
    stream = keys.batch_stream(MODEL, batch_id)
    assert r.xpending(stream, keys.CONSUMER_GROUP)["pending"] == 0  # nothing held: all back, undelivered

    monkeypatch.setattr(engine.model_runner, "sampler", sampler)  # a healthy worker takes them
    done = run_until(make_worker(engine, r, name="w-healthy", max_deliveries=1), r, [batch_id], timeout=60)
    assert done[batch_id]["request_counts"] == {"total": 4, "completed": 4, "failed": 0}


def online_events(r, request_id: str) -> list:
    return online.decode_events(r.xread({keys.reply(request_id): "0-0"}))[1]


def test_a_poisoned_online_request_gets_a_400_and_the_stream_beside_it_completes(engine, r, monkeypatch):
    sampler = engine.model_runner.sampler
    monkeypatch.setattr(engine.model_runner, "sampler",
                        PoisonedSampler(sampler, lambda row: row.params.seed == POISON_SEED))
    worker = make_worker(engine, r)
    now = time.time()
    for request_id, seed in (("good", 1), ("poisoned", POISON_SEED)):
        online.enqueue(r, MODEL, online.OnlineEntry(request_id, "/v1/completions", {
            "model": MODEL, "prompt": f"online {request_id}", "max_tokens": 5, "temperature": 0.5, "seed": seed},
            stream=True, priority=0, deadline=now + 60, enqueued_at=now))
    deadline = time.monotonic() + 60
    while not all(online_events(r, rid) and online_events(r, rid)[-1].is_last for rid in ("good", "poisoned")):
        worker.run_once()
        assert time.monotonic() < deadline
    [error] = online_events(r, "poisoned")
    assert (error.status, error.code) == (400, "engine_error")
    events = online_events(r, "good")
    assert isinstance(events[-1], online.Done) and events[-1].usage["completion_tokens"] == 5
