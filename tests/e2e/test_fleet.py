"""The fleet end to end: worker processes, the finalizer process, a real
redis-server; crashes and signals included."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter

import httpx
import redis

from engine import LLM, SamplingParams
from jobs import batches, heartbeats, keys
from producers.submit import main as submit
from tests.e2e.fleet import wait_terminal
from tests.workers.helpers import completion, read_lines, submit_lines


def workload(n: int, seed: int = 0) -> list[tuple[str, int]]:
    words = "the fleet wakes before the city does and each machine waits for work".split()
    return [(" ".join(words[(i * 7 + k + seed) % len(words)] for k in range(3 + (i * 13) % 40)), 4 + i % 13)
            for i in range(n)]


def output_ids(r, batch) -> list[str]:
    return [line["custom_id"] for line in read_lines(r, batch["output_file_id"])]


def test_three_batches_on_two_workers_exactly_once_and_identical_to_llm(fleet, r, tiny_llama):
    fleet.start_worker("w1")
    fleet.start_worker("w2")
    fleet.wait_ready("w1", "w2")
    items = workload(200)
    sizes = [70, 60, 70]
    batch_ids, start = [], 0
    for size in sizes:
        chunk = items[start:start + size]
        batch_ids.append(submit_lines(r, [completion(f"b{len(batch_ids)}-{i}", p, m)
                                          for i, (p, m) in enumerate(chunk, start)]))
        start += size
    done = wait_terminal(r, batch_ids, timeout=300, fleet=fleet)

    llm = LLM(tiny_llama, num_kv_blocks=256)
    expected = llm.generate([p for p, _ in items], [SamplingParams(temperature=0, max_tokens=m) for _, m in items],
                            use_tqdm=False)
    seen = Counter()
    for index, batch_id in enumerate(batch_ids):
        batch = done[batch_id]
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": sizes[index], "completed": sizes[index], "failed": 0}
        lines = read_lines(r, batch["output_file_id"])
        assert batch["error_file_id"] is None
        prompt_tokens = completion_tokens = 0
        for line in lines:
            seen[line["custom_id"]] += 1
            position = int(line["custom_id"].split("-")[1])
            body = line["response"]["body"]
            assert body["choices"][0]["text"] == expected[position].text
            prompt_tokens += body["usage"]["prompt_tokens"]
            completion_tokens += body["usage"]["completion_tokens"]
        assert batch["usage"]["input_tokens"] == prompt_tokens
        assert batch["usage"]["output_tokens"] == completion_tokens
    assert len(seen) == 200 and set(seen.values()) == {1}
    metrics = httpx.get(f"http://127.0.0.1:{fleet.metrics_ports['w1']}/metrics", timeout=5).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "stream_pending",
                 "stream_lag", "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket"):
        assert f"kvfleet:{name}{{" in metrics, name
    assert 'finished_reason="length"' in metrics
    # Both processes did part of the work.
    assert fleet.metric("w1", "kvfleet:request_success_total") > 0
    assert fleet.metric("w2", "kvfleet:request_success_total") > 0
    assert fleet.metric("w1", "kvfleet:request_success_total") + fleet.metric(
        "w2", "kvfleet:request_success_total") == 200


def wait_in_flight(r: redis.Redis, name: str, batch_id: str, timeout: float = 60) -> int:
    """Until the consumer `name` holds delivered, unacknowledged entries of the batch; how many."""
    deadline = time.monotonic() + timeout
    while True:
        held = {c["name"].decode(): c["pending"]
                for c in r.xpending(keys.batch_stream("tiny", batch_id), keys.CONSUMER_GROUP)["consumers"]}
        if held.get(name):
            return held[name]
        assert time.monotonic() < deadline, f"{name} never held work"
        time.sleep(0.01)


def slow_requests(n: int) -> list[dict]:
    """Long enough (prompt ~150 tokens, 96 new ones, 4 at a time) to be caught mid-flight."""
    return [completion(f"c{i}", p + " and then" * 30, 96) for i, (p, _) in enumerate(workload(n))]


def test_sigkill_loses_nothing_and_doubles_nothing(fleet, r):
    fleet.start_worker("victim", lease_seconds=3, max_num_seqs=4)
    fleet.wait_ready("victim")
    batch_id = submit_lines(r, slow_requests(24))
    assert wait_in_flight(r, "victim", batch_id) > 0
    fleet.processes["victim"].send_signal(signal.SIGKILL)
    fleet.processes["victim"].wait(timeout=10)
    assert r.xpending(keys.batch_stream("tiny", batch_id), keys.CONSUMER_GROUP)["pending"] > 0  # died holding deliveries
    assert batches.batch_object(r, batch_id)["request_counts"]["completed"] < 24
    killed_at = time.monotonic()
    fleet.start_worker("rescuer", lease_seconds=3)
    batch = wait_terminal(r, [batch_id], timeout=120, fleet=fleet)[batch_id]
    assert time.monotonic() - killed_at < 3 + 90  # lease + margin (start-up and the work itself)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 24, "completed": 24, "failed": 0}
    ids = output_ids(r, batch)
    assert sorted(ids) == sorted(f"c{i}" for i in range(24))


def test_kv_aware_pull_balances_by_free_blocks(fleet, r):
    fleet.start_worker("big", num_kv_blocks=96, max_num_seqs=64)
    fleet.start_worker("small", num_kv_blocks=32, max_num_seqs=64)
    fleet.wait_ready("big", "small")
    items = [(p + " and so on" * 6, 64) for p, _ in workload(240, seed=3)]
    batch_id = submit_lines(r, [completion(f"c{i}", p, m) for i, (p, m) in enumerate(items)])
    violations, beats_seen = [], {"big": set(), "small": set()}
    while batches.batch_object(r, batch_id)["status"] not in batches.TERMINAL:
        for name in ("big", "small"):
            record = {k.decode(): v.decode() for k, v in r.hgetall(keys.worker(name)).items()}
            if record and int(record["in_flight"]):
                beats_seen[name].add(record["heartbeat"])
                # Unstarted requests must always fit in the free blocks.
                if int(record["unstarted_blocks_needed"]) > int(record["free_blocks"]):
                    violations.append((name, record))
        time.sleep(0.02)
    assert violations == [], violations[:3]
    assert len(beats_seen["big"]) >= 5 and len(beats_seen["small"]) >= 5, beats_seen
    big = fleet.metric("big", "kvfleet:request_success_total")
    small = fleet.metric("small", "kvfleet:request_success_total")
    assert big + small == 240
    assert big > 1.5 * small, (big, small)


def test_sigterm_drains_and_exits_zero_while_the_other_finishes(fleet, r):
    fleet.start_worker("leaver", num_kv_blocks=128, max_num_seqs=4)
    fleet.start_worker("stayer", num_kv_blocks=128, max_num_seqs=4)
    fleet.wait_ready("leaver", "stayer")
    # 320 tokens each, claimed as the batch lands: the leaver is still decoding its first
    # requests for a second or more after the signal, long enough to be seen draining.
    batch_id = submit_lines(r, [completion(f"c{i}", f"request {i}", 320, ignore_eos=True) for i in range(12)])
    assert wait_in_flight(r, "leaver", batch_id) > 0
    probe = f"http://127.0.0.1:{fleet.metrics_ports['leaver']}"
    assert httpx.get(f"{probe}/healthz", timeout=5).status_code == 200  # what a readiness probe asks
    assert httpx.get(f"{probe}/livez", timeout=5).status_code == 200
    fleet.processes["leaver"].send_signal(signal.SIGTERM)
    deadline, readiness = time.monotonic() + 10, None
    while fleet.processes["leaver"].poll() is None and time.monotonic() < deadline:  # draining: not ready
        try:
            readiness = httpx.get(f"{probe}/healthz", timeout=5)
        except httpx.TransportError:  # it closed its port on the way out
            break
        if readiness.json()["draining"]:
            break
        time.sleep(0.02)
    assert readiness is not None and readiness.status_code == 503 and readiness.json()["draining"] is True
    assert fleet.processes["leaver"].wait(timeout=30) == 0, fleet.log("leaver")
    assert not r.exists(keys.worker("leaver"))
    batch = wait_terminal(r, [batch_id], timeout=180, fleet=fleet)[batch_id]
    assert batch["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    assert sorted(output_ids(r, batch)) == sorted(f"c{i}" for i in range(12))
    # The leaver finished what it held rather than cutting it short.
    assert {line["response"]["body"]["usage"]["completion_tokens"] for line in read_lines(r, batch["output_file_id"])} \
        == {320}
    assert fleet.metric("stayer", "kvfleet:request_success_total") > 0


def test_a_second_sigterm_is_a_cold_shutdown_that_hands_everything_back(fleet, r):
    fleet.start_worker("leaver", drain_seconds=60, max_num_seqs=4)
    fleet.wait_ready("leaver")
    # 480 tokens each: seconds of work in flight when the signals come.
    batch_id = submit_lines(r, [completion(f"c{i}", f"request {i}", 480, ignore_eos=True) for i in range(12)])
    assert wait_in_flight(r, "leaver", batch_id) > 0
    fleet.processes["leaver"].send_signal(signal.SIGTERM)  # drain: up to 60 s
    time.sleep(0.2)
    assert fleet.processes["leaver"].poll() is None and r.hget(keys.worker("leaver"), "draining") == b"1"
    started = time.monotonic()
    fleet.processes["leaver"].send_signal(signal.SIGTERM)  # and now: at once
    assert fleet.processes["leaver"].wait(timeout=20) == 1, fleet.log("leaver")
    assert time.monotonic() - started < 10
    held = {c["name"].decode(): c["pending"] for c in r.xpending(keys.batch_stream("tiny", batch_id), keys.CONSUMER_GROUP)["consumers"]}
    assert held.get("leaver", 0) == 0, "the cold shutdown left entries behind"
    assert "cold shutdown" in fleet.log("leaver")
    fleet.start_worker("stayer", max_num_seqs=4)
    batch = wait_terminal(r, [batch_id], timeout=180, fleet=fleet)[batch_id]
    assert batch["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    assert sorted(output_ids(r, batch)) == sorted(f"c{i}" for i in range(12))


def test_a_worker_serves_its_model_argument_exactly_and_submit_finds_it(fleet, r, redis_server, tiny_llama, tmp_path,
                                                                     capsys):
    assert tiny_llama.startswith("/")
    fleet.start_worker("w-path", served_model_names=None)
    fleet.wait_ready("w-path")
    assert set(heartbeats.served_models(r)) == {tiny_llama}
    source = tmp_path / "in.jsonl"
    source.write_text("".join(f'{{"custom_id": "c{i}", "prompt": "the fleet {i}", "max_tokens": 3}}\n'
                              for i in range(6)))
    common = [str(source), "--redis-url", redis_server.url]
    assert submit([*common, "--model", "no-such-model"]) == 0
    assert f"warning: no live worker serves model 'no-such-model'; live workers serve: '{tiny_llama}'" \
        in capsys.readouterr().err
    assert submit([*common, "--model", "no-such-model", "--require-worker"]) == 2
    assert submit([*common, "--model", tiny_llama, "--require-worker", "--wait", "--json"]) == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.err
    batch = json.loads(captured.out.splitlines()[-1])
    assert batch["status"] == "completed" and batch["model"] == tiny_llama
    assert batch["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    lines = read_lines(r, batch["output_file_id"])
    assert sorted(line["custom_id"] for line in lines) == [f"c{i}" for i in range(6)]
    assert {line["response"]["body"]["model"] for line in lines} == {tiny_llama}
