"""The worker loop in-process, against a real engine, a real redis-server and moto's S3."""

from __future__ import annotations

import time

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from jobs import batches, keys
from tests.services import S3Server
from tests.workers.helpers import MODEL, completion, read_lines, run_until, submit_lines
from workers.worker import Worker, WorkerOptions


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=64, max_num_seqs=8))


@pytest.fixture
def worker(engine, r):
    assert not engine.has_unfinished()
    worker = Worker(engine, r, WorkerOptions(name="w-test", served_model_names=[MODEL], lease_seconds=5, block_ms=50,
                                             maintain_seconds=0.05))
    yield worker
    for lane in worker.lanes:
        lane.release()


def prompts(n: int) -> list[str]:
    return [f"The fleet wakes {i} times before the city" + " and then" * (i % 5) for i in range(n)]


def test_batch_completes_with_greedy_outputs_equal_to_llm_generate(worker, r, tiny_llama):
    chat = {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "Why is memory scarce?"}],
                     "max_tokens": 9, "temperature": 0}}
    texts = prompts(10)
    batch_id = submit_lines(r, [completion(f"c{i}", t, max_tokens=4 + i) for i, t in enumerate(texts)])
    chat_batch = submit_lines(r, [chat])
    done = run_until(worker, r, [batch_id, chat_batch])
    batch = done[batch_id]
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 10, "completed": 10, "failed": 0}
    lines = {line["custom_id"]: line for line in read_lines(r, batch["output_file_id"])}
    assert sorted(lines) == sorted(f"c{i}" for i in range(10))

    llm = LLM(tiny_llama, num_kv_blocks=64)
    expected = llm.generate(texts, [SamplingParams(temperature=0, max_tokens=4 + i) for i in range(10)],
                            use_tqdm=False)
    prompt_tokens = completion_tokens = 0
    for i, output in enumerate(expected):
        body = lines[f"c{i}"]["response"]["body"]
        assert body["choices"][0]["text"] == output.text
        assert body["usage"]["completion_tokens"] == len(output.token_ids)
        assert body["usage"]["prompt_tokens"] == len(output.prompt_token_ids)
        prompt_tokens += len(output.prompt_token_ids)
        completion_tokens += len(output.token_ids)
    assert batch["usage"]["input_tokens"] == prompt_tokens
    assert batch["usage"]["output_tokens"] == completion_tokens

    chat_line = read_lines(r, done[chat_batch]["output_file_id"])[0]
    template_ids = llm.get_tokenizer().apply_chat_template(chat["body"]["messages"], add_generation_prompt=True,
                                                           tokenize=True, return_dict=False)
    reference = llm.generate([template_ids], SamplingParams(temperature=0, max_tokens=9), use_tqdm=False)[0]
    assert chat_line["response"]["body"]["object"] == "chat.completion"
    assert chat_line["response"]["body"]["choices"][0]["message"]["content"] == reference.text
    # Ended batches leave no queue behind: finalize retired their streams (jobs/queues.py).
    assert not r.exists(keys.batch_stream(MODEL, batch_id), keys.batch_stream(MODEL, chat_batch))
    assert r.zcard(keys.queues(MODEL)) == 0


def test_bad_requests_become_error_lines_and_the_worker_survives(worker, r):
    out_of_vocabulary = {"custom_id": "bad-token", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": [5, 99999], "max_tokens": 2}}
    batch_id = submit_lines(r, [
        completion("ok-1", "A queue is a promise"),
        completion("too-long", "word " * 600, max_tokens=8),  # far past max_model_len 512
        out_of_vocabulary,
        completion("ok-2", "Memory is the scarce thing"),
    ])
    # A poison entry that never went through submit: its line is not even JSON.
    r.xadd(keys.batch_stream(MODEL, batch_id), {"batch_id": batch_id, "custom_id": "poison", "line_number": 9, "line": "{oops"})
    r.hincrby(keys.batch(batch_id), "total", 1)
    # And one that is no entry at all: it can only go to the dead letters.
    r.xadd(keys.batch_stream(MODEL, batch_id), {"garbage": "1"})
    batch = run_until(worker, r, [batch_id])[batch_id]
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 5, "completed": 2, "failed": 3}
    errors = {line["custom_id"]: line["error"] for line in read_lines(r, batch["error_file_id"])}
    assert errors["too-long"]["code"] == "context_length_exceeded"
    assert "max_model_len 512" in errors["too-long"]["message"]
    assert errors["bad-token"]["code"] == "invalid_request"
    assert "token ids must be integers in [0, 512)" in errors["bad-token"]["message"]
    assert errors["poison"]["code"] == "invalid_request" and "not valid JSON" in errors["poison"]["message"]
    dead = r.xrange(keys.dead_letters(keys.batch_stream(MODEL, batch_id)))
    assert len(dead) == 1 and dead[0][1][b"error"] == b"malformed stream entry"
    # The worker carries on with the next batch.
    after = submit_lines(r, [completion("later", "Questions and answers")])
    assert run_until(worker, r, [after])[after]["status"] == "completed"


def slow_batch(r, n: int, **options) -> str:
    """Long enough (96 new tokens each, 8 at a time) to be caught mid-batch."""
    return submit_lines(r, [completion(f"c{i}", t, max_tokens=96) for i, t in enumerate(prompts(n))], **options)


def test_cancel_mid_batch_keeps_partial_results_and_runs_nothing_more(worker, r):
    batch_id = slow_batch(r, 40)
    while batches.batch_object(r, batch_id)["request_counts"]["completed"] < 3:
        worker.run_once()
    batches.transition(r, batch_id, "cancelling")
    completed_at_cancel = batches.batch_object(r, batch_id)["request_counts"]["completed"]
    batch = run_until(worker, r, [batch_id])[batch_id]
    assert batch["status"] == "cancelled"
    counts = batch["request_counts"]
    assert counts["completed"] + counts["failed"] == 40
    # Requests that finish within the same step as the cancel may still land; nothing later does.
    assert completed_at_cancel <= counts["completed"] <= completed_at_cancel + worker.engine.config.max_num_seqs
    assert len(read_lines(r, batch["output_file_id"])) == counts["completed"]
    errors = read_lines(r, batch["error_file_id"])
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"} and len(errors) == counts["failed"]
    assert not worker.num_in_flight and not worker.engine.has_unfinished()


def test_expired_batch_keeps_partial_results(worker, r):
    batch_id = slow_batch(r, 64, completion_window="1h")
    while batches.batch_object(r, batch_id)["request_counts"]["completed"] < 3:
        worker.run_once()
    # The window runs out now (moved, rather than waited for, so that engine speed cannot decide it).
    r.hset(keys.batch(batch_id), "expires_at", int(time.time()) - 1)
    batch = run_until(worker, r, [batch_id], timeout=60)[batch_id]
    assert batch["status"] == "expired" and batch["expired_at"] is not None
    counts = batch["request_counts"]
    assert counts["total"] == 64 and counts["completed"] + counts["failed"] == 64
    assert 0 < counts["completed"] < 64
    codes = {e["error"]["code"] for e in read_lines(r, batch["error_file_id"])}
    assert codes == {"batch_expired"}


def test_s3_outage_mid_batch_lands_everything_exactly_once(worker, r, s3_server, s3_bucket):
    batch_id = submit_lines(r, [completion(f"c{i}", t, max_tokens=12) for i, t in enumerate(prompts(24))],
                            sink=f"s3://{s3_bucket}/out")
    while batches.batch_object(r, batch_id)["request_counts"]["completed"] < 4:
        worker.run_once()
    s3_server.stop()
    outage_end = time.monotonic() + 3
    while time.monotonic() < outage_end:
        worker.run_once()
    during = batches.batch_object(r, batch_id)["request_counts"]["completed"]
    assert during < 24 and worker.batch_lane.flusher, "results must wait for S3, not be acknowledged"
    pending = r.xpending(keys.batch_stream(MODEL, batch_id), keys.CONSUMER_GROUP)["pending"]
    assert pending >= len(worker.batch_lane.flusher)  # nothing acked before it is durable
    restarted = S3Server(port=s3_server.port).start()  # moto keeps its buckets in-process
    try:
        batch = run_until(worker, r, [batch_id], timeout=120)[batch_id]
    finally:
        s3_server.server = restarted.server
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 24, "completed": 24, "failed": 0}
    ids = [line["custom_id"] for line in read_lines(r, batch["output_file_id"])]
    assert sorted(ids) == sorted(f"c{i}" for i in range(24))


def test_redis_restart_mid_batch_loses_and_doubles_nothing(worker, r, redis_server):
    batch_id = submit_lines(r, [completion(f"c{i}", t, max_tokens=12) for i, t in enumerate(prompts(30))])
    while batches.batch_object(r, batch_id)["request_counts"]["completed"] < 5:
        worker.run_once()
    time.sleep(1.2)  # let appendfsync everysec persist what was acknowledged
    redis_server.kill()
    flushes, flush = [], worker.batch_lane.flusher.flush
    worker.batch_lane.flusher.flush = lambda: (flushes.append(1), flush())
    outage_end = time.monotonic() + 2
    while time.monotonic() < outage_end:
        worker.run_once()  # must not raise: it backs off and keeps the engine going
    # Capped exponential back-off (0.1, 0.2, 0.4, 0.8 s ...): a handful of tries, not one per loop.
    assert len(flushes) <= 8, len(flushes)
    worker.batch_lane.flusher.flush = flush
    redis_server.start()
    batch = run_until(worker, r, [batch_id], timeout=120)[batch_id]
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 30, "completed": 30, "failed": 0}
    ids = [line["custom_id"] for line in read_lines(r, batch["output_file_id"])]
    assert sorted(ids) == sorted(f"c{i}" for i in range(30))
    assert batches.num_counted(r, batch_id) == 30


def test_n_samples_come_back_as_n_choices_with_summed_usage(worker, r):
    line = {"custom_id": "many", "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": "Summaries should be short and faithful.", "n": 3,
                     "temperature": 0.9, "seed": 5, "max_tokens": 6, "ignore_eos": True, "logprobs": 2}}
    batch_id = submit_lines(r, [line])
    batch = run_until(worker, r, [batch_id])[batch_id]
    body = read_lines(r, batch["output_file_id"])[0]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 18
    assert all(len(c["logprobs"]["token_logprobs"]) == 6 for c in body["choices"])
    assert all(len(top) == 2 for c in body["choices"] for top in c["logprobs"]["top_logprobs"])
    assert batch["usage"]["output_tokens"] == 18


def test_heartbeat_reports_the_model_and_its_active_parameters(tiny_models, r):
    from jobs import heartbeats

    engine = LLMEngine(EngineConfig(model=tiny_models["qwen3_moe"], num_kv_blocks=16, onednn_linear=False,
                                    kv_cache_dtype="fp8"))
    worker = Worker(engine, r, WorkerOptions(name="w-moe", served_model_names=["moe"], maintain_seconds=0.05))
    try:
        worker._heartbeat()
        record = heartbeats.live_workers(r)[0]
    finally:
        for lane in worker.lanes:
            lane.release()
    total = sum(p.numel() for p in engine.model_runner.model.parameters())
    experts = sum(p.numel() for name, p in engine.model_runner.model.named_parameters() if ".experts." in name)
    assert record["num_params"] == total
    assert record["num_active_params"] == total - experts + experts * 4 // 8  # top 4 of 8 experts
    assert (record["weights"], record["kv_cache_dtype"]) == ("float32", "fp8_e4m3")
