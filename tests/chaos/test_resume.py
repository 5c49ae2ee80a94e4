"""Resumable generations under chaos: 64 long generations (greedy and seeded, n=1 and n=2,
some constrained by a JSON schema) while workers are killed with kill -9 at random moments
and one is stopped with SIGTERM in --drain-mode migrate. Every output equals an
uninterrupted run's, the batch completes exactly once, and the tokens generated twice (the
fleet's own per-step counters, kept by prometheus_client's multiprocess mode so that a
killed worker's survive it) stay within 5% of all generated tokens."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, multiprocess

from engine import LLM
from jobs import batches, keys
from jobs.schemas import parse_line
from tests.chaos.conftest import at_progress, wait_for
from tests.chaos.history import check_history
from tests.e2e.fleet import Fleet, wait_terminal
from tests.workers.helpers import read_lines, submit_lines
from workers.translate import to_engine_request

WORDS = "the ledger of each night keeps what the fleet wrote before the city woke".split()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
          "required": ["name", "count"], "additionalProperties": False}


@pytest.fixture
def metrics_dir(tmp_path) -> Path:
    path = tmp_path / "metrics"
    path.mkdir()
    return path


@pytest.fixture
def fleet(tiny_llama, chaos_redis, metrics_dir, tmp_path):
    fleet = Fleet(tiny_llama, chaos_redis.url, tmp_path, env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
    yield fleet
    fleet.stop()


def lines(n: int, seed: int) -> list[dict]:
    """Long generations of five kinds, interleaved."""
    rng = random.Random(seed)
    kinds = [{"temperature": 0}, {"temperature": 0.9, "seed": 7}, {"n": 2, "temperature": 1.0, "seed": 3},
             {"n": 2, "temperature": 0}, {"temperature": 0.8, "seed": 5, "response_format": {
                 "type": "json_schema", "json_schema": {"name": "row", "schema": SCHEMA, "strict": True}}}]
    records = []
    for i in range(n):
        body = {"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))),
                "max_tokens": rng.randint(200, 400), **kinds[i % len(kinds)]}
        if "response_format" not in body:
            body["ignore_eos"] = True
        records.append({"custom_id": f"g{i}", "method": "POST", "url": "/v1/completions", "body": body})
    return records


def uninterrupted(model: str, records: list[dict]) -> dict[str, list[str]]:
    """Each line's choice texts, run without interruption in this process, on the sampling
    parameters the worker derives from the line."""
    llm = LLM(model, num_kv_blocks=2048, max_num_seqs=64)
    requests = [to_engine_request(parse_line(json.dumps(record), number), llm.engine.tokenizer,
                                  llm.engine.default_sampling_params) for number, record in enumerate(records, 1)]
    outputs = llm.generate([request.prompt_token_ids for request in requests],
                           [request.params for request in requests], use_tqdm=False)
    return {record["custom_id"]: [choice.text for choice in output.outputs]
            for record, output in zip(records, outputs)}


def held_by(r, consumer: str) -> int:
    """Entries of the demo model's batch streams delivered to `consumer` and not acked."""
    return sum(len(r.xpending_range(stream, keys.CONSUMER_GROUP, "-", "+", 1000, consumername=consumer))
               for stream in r.scan_iter(match=f"{keys.PREFIX}:stream:*"))


def fleet_counter(metrics_dir: Path, name: str) -> float:
    """A counter summed over every worker process that ever ran, killed ones included."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(metrics_dir))
    return sum(sample.value for metric in registry.collect() for sample in metric.samples
               if sample.name == f"{name}_total")


def test_kill_9_and_migrate_mid_generation_lose_no_output_and_regenerate_under_5_percent(fleet, r, tiny_llama,
                                                                                          metrics_dir):
    rng = random.Random(20261202)
    fleet.start_finalizer("--sweep-seconds", "1", "--grace-seconds", "3")
    options = dict(lease_seconds=2, max_num_seqs=16, num_kv_blocks=256,
                   extra=("--max-deliveries", "50", "--drain-mode", "migrate"))
    names = ["w0", "w1"]
    for name in names:
        fleet.start_worker(name, **options)
    fleet.wait_ready(*names)
    records = lines(64, seed=3)
    batch_id = submit_lines(r, [{"custom_id": rec["custom_id"], **rec["body"]} for rec in records])
    # Three kills, then a migrating drain, by progress (one in each eighth of the batch from the
    # first to the fourth): mid-generation whatever the host's speed, with half the batch to go.
    moments = [rng.uniform((k + 0.1) / 8, (k + 0.9) / 8) for k in range(4)]
    for stop, _ in enumerate(at_progress(r, batch_id, moments, fleet)):
        assert batches.batch_object(r, batch_id)["status"] == "in_progress", f"ended after {stop} stops"
        index = rng.randrange(len(names))
        process = fleet.processes[names[index]]
        if stop < 3:
            process.kill()
            assert process.wait(timeout=10) == -signal.SIGKILL
        else:
            fleet.wait_ready(names[index])  # a worker still loading its model just exits
            name = names[index]
            wait_for(lambda name=name: held_by(r, name) > 0, 120, "the worker to take work", fleet)
            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            while held_by(r, names[index]):  # each entry handed back, with its checkpoint
                time.sleep(0.01)
            handed_back = time.monotonic() - started
            assert process.wait(timeout=10) == 0
            print(f"migrate: handed back in {handed_back:.2f} s, exited in {time.monotonic() - started:.2f} s")
            assert handed_back < 2.0
        names[index] = f"w{index}.{stop}"  # a restarted pod: a new consumer name
        fleet.start_worker(names[index], **options)
    wait_terminal(r, [batch_id], timeout=240, fleet=fleet)
    [batch] = check_history(r, {batch_id: {rec["custom_id"] for rec in records}}).values()
    assert batch["request_counts"] == {"total": 64, "completed": 64, "failed": 0}

    outputs = {line["custom_id"]: line["response"]["body"] for line in read_lines(r, batch["output_file_id"])}
    expected = uninterrupted(tiny_llama, records)
    for custom_id, texts in expected.items():
        assert [choice["text"] for choice in outputs[custom_id]["choices"]] == texts, custom_id
    for record in records:
        if "response_format" in record["body"]:
            for choice in outputs[record["custom_id"]]["choices"]:
                if choice["finish_reason"] == "stop":
                    assert set(json.loads(choice["text"])) == {"name", "count"}

    generated = sum(body["usage"]["completion_tokens"] for body in outputs.values())
    sampled = fleet_counter(metrics_dir, "kvfleet:generation_tokens")
    resumed = fleet_counter(metrics_dir, "kvfleet:resumed_tokens")
    print(f"generated {generated}, sampled {sampled:.0f}, twice {sampled - generated:.0f}, resumed {resumed:.0f}")
    assert resumed > 0  # the stops landed mid-generation, and the heirs continued
    assert 0 <= sampled - generated <= 0.05 * generated
