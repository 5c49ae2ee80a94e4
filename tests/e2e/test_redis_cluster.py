"""kvfleet on a real Redis Cluster (3 masters, a replica each, started by the test):
a model's stream split into partitions over the masters, a worker killed with -9,
a failover mid-batch; every batch ends exactly once and the API reads it; online
requests stream through the cluster."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from jobs import batches, keys
from jobs.connection import connect
from producers.api import create_app
from producers.submit import main as submit_cli
from tests.e2e.fleet import Fleet, wait_terminal
from tests.services import ThreadedUvicorn
from tests.workers.helpers import MODEL, completion, read_lines, run_until, submit_lines
from workers.worker import Worker, WorkerOptions


def batch_streams(batch_id: str, num_lines: int) -> list[str]:
    partitions = {keys.partition_of(batch_id, i, keys.NUM_CLUSTER_PARTITIONS) for i in range(num_lines)}
    return [keys.batch_stream(MODEL, batch_id, partition) for partition in sorted(partitions)]


def held_by(cluster, streams: list[str], name: str) -> int:
    return sum(consumer["pending"] for stream in streams if cluster.exists(stream)
               for consumer in cluster.xpending(stream, keys.CONSUMER_GROUP)["consumers"]
               if consumer["name"].decode() == name)


def test_a_large_batch_spreads_over_partitions_on_several_masters(cluster, redis_cluster, tmp_path, capsys):
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"doc-{i}", "prompt": f"Summarize {i}.", "max_tokens": 4})
                            + "\n" for i in range(2000)))
    assert submit_cli([str(path), "--redis-url", redis_cluster.url, "--model", MODEL]) == 0
    batch_id = capsys.readouterr().out.split()[0]
    streams_on = {}
    for port in redis_cluster.masters():  # each master's own keys, read directly from it
        node = redis.Redis(port=port)
        streams_on[port] = {key.decode(): node.xlen(key) for key in node.scan_iter("kvfleet:stream:*")}
    assert sum(len(streams) > 0 for streams in streams_on.values()) >= 2, streams_on
    lengths = {stream: length for streams in streams_on.values() for stream, length in streams.items()}
    assert len(lengths) == keys.NUM_CLUSTER_PARTITIONS and sum(lengths.values()) == 2000
    assert set(lengths) == set(batch_streams(batch_id, 2000))
    totals = [int(cluster.hget(keys.partition_counts(batch_id, p), "total") or 0)
              for p in range(keys.NUM_CLUSTER_PARTITIONS)]
    assert sum(totals) == 2000 and batches.batch_object(cluster, batch_id)["request_counts"]["total"] == 2000
    # A re-run enqueues nothing twice (each chunk is marked in its partition).
    assert submit_cli([str(path), "--redis-url", redis_cluster.url, "--model", MODEL, "--batch-id", batch_id]) == 0
    assert sum(cluster.xlen(stream) for stream in lengths) == 2000


def test_two_workers_one_killed_the_batch_ends_exactly_once_and_the_api_reads_it(
        cluster, redis_cluster, redis_server, tiny_llama, tmp_path):
    fleet = Fleet(tiny_llama, redis_cluster.url, tmp_path, env={"KVFLEET_QUEUE_URL": redis_server.url})
    try:
        fleet.start_finalizer()
        fleet.start_worker("victim", lease_seconds=3, max_num_seqs=4)
        fleet.start_worker("survivor", lease_seconds=3, max_num_seqs=4)
        fleet.wait_ready("victim", "survivor")
        records = [completion(f"c{i}", f"document {i} says" + " and then" * 20, 24) for i in range(240)]
        batch_id = submit_lines(cluster, records)
        streams = batch_streams(batch_id, 240)
        assert len(streams) == 3  # 100 + 100 + 40 lines
        deadline = time.monotonic() + 60
        while not held_by(cluster, streams, "victim"):
            assert time.monotonic() < deadline, fleet.log("victim")
            time.sleep(0.01)
        fleet.processes["victim"].send_signal(signal.SIGKILL)
        fleet.processes["victim"].wait(timeout=10)
        batch = wait_terminal(cluster, [batch_id], timeout=240, fleet=fleet)[batch_id]
        assert fleet.metric("survivor", "kvfleet:request_success_total") > 0
    finally:
        fleet.stop()
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 240, "completed": 240, "failed": 0}
    with ThreadedUvicorn(create_app(redis_cluster.url)) as api, httpx.Client(base_url=api.url) as client:
        assert client.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"] == 240
        content = client.get(f"/v1/files/{batch['output_file_id']}/content")
        assert content.status_code == 200
    ids = [json.loads(line)["custom_id"] for line in content.text.splitlines()]
    assert sorted(ids) == sorted(f"c{i}" for i in range(240))  # each once


def test_a_worker_rides_out_a_failover_mid_batch(cluster, redis_cluster, tiny_llama):
    engine = LLMEngine(EngineConfig(model=tiny_llama, num_kv_blocks=64, max_num_seqs=16))
    worker = Worker(engine, cluster, WorkerOptions(name="w", served_model_names=[MODEL], block_ms=50,
                                                   maintain_seconds=0.05, max_backoff_seconds=0.5))
    batch_id = submit_lines(cluster, [completion(f"c{i}", f"text {i}", 6) for i in range(300)])
    deadline = time.monotonic() + 60
    while batches.num_counted(cluster, batch_id) < 50:
        worker.run_once()
        assert time.monotonic() < deadline
    # The master of the batch's first partition hands over to its replica (CLUSTER FAILOVER).
    old_master = cluster.get_node_from_key(batch_streams(batch_id, 300)[0]).port
    deadline = time.monotonic() + 20
    while not (replicas := redis.Redis(port=old_master).role()[2]):  # a busy host: its link may be resyncing
        worker.run_once()
        assert time.monotonic() < deadline, "the master has no connected replica"
    replica = replicas[0][1]
    redis.Redis(port=int(replica)).execute_command("CLUSTER", "FAILOVER")
    deadline = time.monotonic() + 20
    while redis.Redis(port=old_master).role()[0] != b"slave":
        worker.run_once()
        assert time.monotonic() < deadline, "the failover did not happen"
    done = run_until(worker, cluster, [batch_id], timeout=120)[batch_id]
    assert int(replica) in redis_cluster.masters()
    assert done["request_counts"] == {"total": 300, "completed": 300, "failed": 0}
    assert sorted(line["custom_id"] for line in read_lines(cluster, done["output_file_id"])) == \
        sorted(f"c{i}" for i in range(300))


def test_online_requests_through_the_cluster(cluster, redis_cluster, demo_model):
    from tests.online.conftest import MODEL as ONLINE_MODEL
    from tests.online.conftest import WorkerThread

    engine = LLMEngine(EngineConfig(model=demo_model, num_kv_blocks=64, max_num_seqs=4))
    reference = LLM(demo_model, num_kv_blocks=64).generate(["The cluster"], SamplingParams(temperature=0, max_tokens=8),
                                                          use_tqdm=False)[0].text
    with ThreadedUvicorn(create_app(redis_cluster.url)) as api, WorkerThread(engine, redis_cluster.url) as worker:
        worker._heartbeat()
        client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0)
        whole = client.completions.create(model=ONLINE_MODEL, prompt="The cluster", max_tokens=8, temperature=0)
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=ONLINE_MODEL, prompt="The cluster", max_tokens=8, temperature=0, stream=True) if chunk.choices)
    assert whole.choices[0].text == streamed == reference


def test_the_documented_acl_with_cluster_slots_is_enough_on_a_cluster(cluster, redis_cluster):
    readme = (Path(__file__).resolve().parents[2] / "docs" / "deployment.md").read_text()
    rule = re.search(r"^user kvfleet (.*)$", readme, re.MULTILINE).group(1).replace(">PASSWORD", ">secret").split()
    for port in [node.port for node in redis_cluster.nodes]:
        redis.Redis(port=port).execute_command("ACL", "SETUSER", "kvfleet", "reset", *rule, "+cluster|slots")
    user_url = redis_cluster.url.replace("redis+cluster://", "redis+cluster://kvfleet:secret@")
    client = connect(user_url)
    batch_id = submit_lines(client, [completion(f"c{i}", f"text {i}") for i in range(150)])
    assert batches.batch_object(client, batch_id)["request_counts"]["total"] == 150
    assert sum(client.xlen(stream) for stream in batch_streams(batch_id, 150)) == 150


@pytest.mark.parametrize("module", ["workers", "workers.finalizer", "producers.api"])
def test_a_cluster_without_a_queue_redis_is_refused_at_start_up(cluster, redis_cluster, tiny_llama, module):
    env = {k: v for k, v in os.environ.items() if k != "KVFLEET_QUEUE_URL"}
    argv = ["--model", tiny_llama] if module == "workers" else []
    done = subprocess.run([sys.executable, "-m", module, *argv, "--redis-url", redis_cluster.url], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "error: with a Redis Cluster, set KVFLEET_QUEUE_URL to a plain Redis (redis:// or rediss://) for the "
        "finalize queue: RQ cannot run on a cluster")
