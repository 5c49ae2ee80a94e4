"""What one request costs the broker, and how many requests/s one Redis core carries.

    python -m benchmarks.broker_cost [--num-requests 2000] [--clients 3] [--seconds 10] [--cluster]

1. The real path on the demo model: `producers.ingest.submit`, one in-process worker
   (pull, lease renewals, results, acks, heartbeats) and the finalize job, on a
   redis-server of its own. Per phase and per request: Redis commands (from INFO
   commandstats deltas, commands that Lua scripts run included), round trips (counted
   on the client's connections) and bytes in and out (INFO stats), and the server's CPU
   seconds (INFO cpu).
2. One Redis core's capacity for that mix, measured: `--clients` processes run the
   broker side of the same path with no model (submit batches, pull, record results with
   their acks, finalize) as fast as they can for `--seconds`; requests/s and the server's
   CPU share while they do.
With --cluster, part 1 runs on a local Redis Cluster (3 masters, the finalize queue on a
plain Redis of its own) and the counters are summed over every server: what partitioning
costs. Prints a table and a JSON summary; the README's capacity table is computed from it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import redis
import redis.connection

from benchmarks.common import print_summary
from engine import EngineConfig, LLMEngine
from engine.demo_model import demo_config, write_checkpoint
from jobs import batches, keys
from jobs.connection import connect
from jobs.finalize import run_queued_jobs as run_finalize_jobs
from jobs.local_redis import RedisClusterServers, RedisServer
from jobs.recording import record_result
from jobs.results import Usage, success_line
from jobs.storage import RedisStorage
from producers.ingest import submit
from workers import stream_ops
from workers.worker import Worker, WorkerOptions

MODEL = "bench"
ROUND_TRIPS = Counter()  # connection id -> packed sends (one per command or pipeline)


def _count_round_trips() -> None:
    original = redis.connection.AbstractConnection.send_packed_command

    def counted(self, command, check_health=True):
        ROUND_TRIPS["total"] += 1
        return original(self, command, check_health)

    redis.connection.AbstractConnection.send_packed_command = counted


class Snapshot:
    """The servers' counters at one moment, summed, read on connections kept out of the
    round-trip count."""

    def __init__(self, admins: list[redis.Redis]) -> None:
        sent_before = ROUND_TRIPS["total"]
        self.commands: Counter = Counter()
        self.cpu = self.bytes_in = self.bytes_out = 0
        for admin in admins:
            stats, cpu, server = admin.info("commandstats"), admin.info("cpu"), admin.info("stats")
            self.commands.update({name.removeprefix("cmdstat_"): value["calls"] for name, value in stats.items()})
            self.cpu += cpu["used_cpu_sys"] + cpu["used_cpu_user"]
            self.bytes_in += server["total_net_input_bytes"]
            self.bytes_out += server["total_net_output_bytes"]
        ROUND_TRIPS["total"] = sent_before  # the INFO calls themselves are not the workload's
        self.round_trips = sent_before

    def delta(self, later: Snapshot, num_requests: int) -> dict:
        commands = {name: later.commands[name] - self.commands.get(name, 0) for name in later.commands}
        commands = {name: count for name, count in commands.items()
                    if count and name not in ("info", "cluster|slots", "cluster|shards", "command|docs")}
        return {"commands_per_request": round(sum(commands.values()) / num_requests, 2),
                "round_trips_per_request": round((later.round_trips - self.round_trips) / num_requests, 3),
                "bytes_in_per_request": round((later.bytes_in - self.bytes_in) / num_requests),
                "bytes_out_per_request": round((later.bytes_out - self.bytes_out) / num_requests),
                "server_cpu_ms_per_request": round(1000 * (later.cpu - self.cpu) / num_requests, 4),
                "commands": dict(sorted(commands.items(), key=lambda item: -item[1]))}


def lines(num_requests: int, tag: str) -> list[bytes]:
    return [(f'{{"custom_id": "{tag}-{i}", "prompt": "Summarize document {i} in a few words.", '
             f'"max_tokens": 4, "temperature": 0}}').encode() for i in range(num_requests)]


def measure_real_path(url: str, admins: list[redis.Redis], model_dir: str, num_requests: int) -> dict:
    r = connect(url)
    engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=512, max_num_seqs=64))
    worker = Worker(engine, r, WorkerOptions(name="bench", served_model_names=[MODEL], block_ms=20))
    worker.run_once()  # consumer groups exist before the clock starts
    phases, start = {}, Snapshot(admins)
    batch_id = submit(r, lambda: lines(num_requests, "r"), model=MODEL).batch_id
    submitted = Snapshot(admins)
    phases["submit"] = start.delta(submitted, num_requests)
    while batches.num_counted(r, batch_id) < num_requests or worker.batch_lane.flusher:
        worker.run_once()
    worked = Snapshot(admins)
    phases["worker"] = submitted.delta(worked, num_requests)
    assert run_finalize_jobs(r) == 1 and batches.batch_object(r, batch_id)["status"] == "completed"
    finalized = Snapshot(admins)
    phases["finalize"] = worked.delta(finalized, num_requests)
    phases["total"] = start.delta(finalized, num_requests)
    return phases


def broker_client(url: str, index: int, seconds: float, batch_size: int, results: multiprocessing.Queue) -> None:
    """The broker side of the path with no model: submit, pull, record + ack, finalize."""
    r = redis.Redis.from_url(url)
    consumer, storage = f"client-{index}", RedisStorage(r)
    usage, body = Usage(12, 4), {"object": "text_completion", "choices": [{"index": 0, "text": "four words of text",
                                                                           "finish_reason": "length"}]}
    done, deadline, rounds, batch_ids = 0, time.monotonic() + seconds, 0, []
    while time.monotonic() < deadline:
        batch_lines = lines(batch_size, f"c{index}-{rounds}")
        batch_id = submit(r, lambda batch_lines=batch_lines: batch_lines, model=MODEL).batch_id
        stream = keys.batch_stream(MODEL, batch_id)  # each batch has its own (jobs/queues.py)
        rounds += 1
        while True:
            entries = stream_ops.pull(r, consumer, 64, 60_000, [], [stream], None)
            if not entries:
                break
            for _, entry_id, fields, _ in entries:
                custom_id = fields[b"custom_id"].decode()
                record_result(r, storage, fields[b"batch_id"].decode(), success_line(custom_id, body), usage,
                              ack=(stream, keys.CONSUMER_GROUP, entry_id))
                done += 1
        run_finalize_jobs(r)  # the batches every client's results completed so far
        batch_ids.append(batch_id)
    results.put((done, batch_ids))


def measure_capacity(url: str, clients: int, seconds: float) -> dict:
    admin = redis.Redis.from_url(url)
    admins = [admin]
    results = multiprocessing.Queue()
    before = Snapshot(admins)
    started = time.perf_counter()
    processes = [multiprocessing.Process(target=broker_client, args=(url, i, seconds, 200, results))
                 for i in range(clients)]
    for process in processes:
        process.start()
    reports = [results.get(timeout=seconds + 600) for _ in processes]  # before join: the queue must drain
    for process in processes:
        process.join()
    elapsed = time.perf_counter() - started
    after = Snapshot(admins)
    num_requests = sum(done for done, _ in reports)
    run_finalize_jobs(admin)
    assert all(batches.batch_object(admin, batch_id)["status"] == "completed"
               for _, batch_ids in reports for batch_id in batch_ids)
    cpu_share = (after.cpu - before.cpu) / elapsed
    return {"clients": clients, "seconds": round(elapsed, 2), "requests": num_requests,
            "requests_per_s": round(num_requests / elapsed), "redis_cpu_share": round(cpu_share, 2),
            "requests_per_s_at_one_core": round(num_requests / elapsed / max(cpu_share, 1e-9)),
            # round trips are counted in this process only: the clients' are not
            **{k: v for k, v in before.delta(after, num_requests).items() if k not in ("commands", "round_trips_per_request")}}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.broker_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--cluster", action="store_true", help="part 1 on a local 3-master Redis Cluster")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model_dir = str(write_checkpoint(demo_config(), Path(folder) / "model"))
        server = RedisServer(Path(folder) / "redis").start()
        cluster = RedisClusterServers(Path(folder) / "cluster").start() if args.cluster else None
        try:
            _count_round_trips()
            if cluster:  # the finalize queue on the plain server, as a cluster fleet runs it
                os.environ.update(KVFLEET_QUEUE_URL=server.url, KVFLEET_REDIS_URL=cluster.url)
                admins = [redis.Redis(port=node.port) for node in cluster.nodes] + [redis.Redis.from_url(server.url)]
                phases = measure_real_path(cluster.url, admins, model_dir, args.num_requests)
                capacity = None
            else:
                phases = measure_real_path(server.url, [redis.Redis.from_url(server.url)], model_dir,
                                           args.num_requests)
                redis.Redis.from_url(server.url).flushall()
                capacity = measure_capacity(server.url, args.clients, args.seconds)
        finally:
            server.kill()
            if cluster:
                cluster.stop()
    print(f"{'phase':10s} {'commands':>9s} {'round trips':>12s} {'bytes in':>9s} {'bytes out':>10s} {'cpu ms':>8s}"
          "   (per request)")
    for name, phase in phases.items():
        print(f"{name:10s} {phase['commands_per_request']:9.2f} {phase['round_trips_per_request']:12.3f} "
              f"{phase['bytes_in_per_request']:9d} {phase['bytes_out_per_request']:10d} "
              f"{phase['server_cpu_ms_per_request']:8.4f}")
    if capacity:
        print(f"capacity: {capacity['clients']} clients, {capacity['requests_per_s']:,} requests/s at "
              f"{capacity['redis_cpu_share']:.0%} of one Redis core -> {capacity['requests_per_s_at_one_core']:,} "
              f"requests/s per core")
    print_summary({"benchmark": "broker_cost", "cluster": args.cluster, "num_requests": args.num_requests,
                   "phases": phases, "capacity": capacity})


if __name__ == "__main__":
    main()
