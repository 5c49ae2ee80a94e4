"""The control plane's cost against the number of open batches: a simulated fleet (workers on
an engine without a model that answers at once: benchmarks/instant_engine.py) on one Redis and
on a 3-master Redis Cluster, with 10 to 20,000 open batches across 100 tenants.

    python -m benchmarks.control_plane [--open 10,1000,20000] [--tenants 100] [--workers 4]
                                       [--seconds 15] [--lines 20000] [--no-cluster]

Every run holds the same backlog (--lines, split evenly over the open batches), so only the
number of open batches changes. For each, over --seconds of steady work:
  * Redis commands per worker per second, and per request served (commands, not round trips:
    a pipeline of 20 is 20), counted on each worker's own client;
  * the time from a new tenant's enqueue to its first pull, with everyone else backlogged;
  * fair-share error: how far the tenants' requests started over the window (counted at fair
    share's own charge, on every worker) fall from an even split (all weigh 1, all backlogged
    throughout): max |started - mean| / mean.
Goal: flat per-worker commands from 10 to 20,000 open batches, first pull under 1 s, fair
share within 10%. Peers: none (no other system has this queue); the row at 10 open batches is
the baseline the others are read against.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import redis

from benchmarks.common import print_summary
from benchmarks.instant_engine import InstantConfig, InstantEngine
from jobs import keys
from jobs.connection import connect
from jobs.local_redis import RedisClusterServers, RedisServer
from producers.ingest import submit

MODEL = "bench"


class CommandCounter:
    """Commands sent by every connection of one client (pipelined ones one each)."""

    def __init__(self) -> None:
        self.count, self.lock = 0, threading.Lock()

    def add(self, number: int = 1) -> None:
        with self.lock:
            self.count += number

    def reset(self) -> int:
        with self.lock:
            count, self.count = self.count, 0
        return count


def counting_client(url: str, counter: CommandCounter) -> redis.Redis:
    """A client on `url` whose every command is counted by `counter`."""

    class Counting(redis.Connection):
        def send_command(self, *args, **kwargs):
            counter.add()
            return super().send_command(*args, **kwargs)

        def pack_commands(self, commands):  # a pipeline's
            commands = list(commands)
            counter.add(len(commands))
            return super().pack_commands(commands)

    return connect(url, connection_class=Counting)


def fill(r: redis.Redis, num_batches: int, num_lines: int, num_tenants: int) -> None:
    """`num_lines` one-token requests over `num_batches` batches, the batches over the tenants."""
    per_batch = max(1, num_lines // num_batches)
    for index in range(num_batches):
        lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                             "body": {"prompt": [1, 2, 3], "max_tokens": 1}}).encode() for i in range(per_batch)]
        assert submit(r, lambda lines=lines: lines, model=MODEL, tenant=f"t{index % num_tenants}").accepted


def count_into(method, counter: CommandCounter, into: CommandCounter):
    """`method`, with the commands it sends also counted in `into`."""
    def counted(*args, **kwargs):
        before = counter.count
        try:
            return method(*args, **kwargs)
        finally:
            into.add(counter.count - before)
    return counted


class Started:
    """Requests the workers started, by tenant (fair share's own charge, so the count is exact
    and instantaneous)."""

    def __init__(self) -> None:
        self.by_tenant: Counter = Counter()
        self.lock = threading.Lock()

    def watch(self, charge):
        def counted(tenant: str, weight: float, num_tokens: int) -> None:
            with self.lock:
                self.by_tenant[tenant] += 1
            charge(tenant, weight, num_tokens)
        return counted

    def take(self) -> Counter:
        with self.lock:
            taken, self.by_tenant = self.by_tenant, Counter()
        return taken


def start_workers(url: str, num_workers: int,
                  started: Started) -> tuple[list, list[tuple[CommandCounter, CommandCounter]], list]:
    """Workers in threads, each with a counter of all its commands and one of what it sends to
    choose and read its batch work (ServedStreams: refresh, read, with_pending)."""
    from workers.worker import Worker, WorkerOptions  # noqa: PLC0415

    fleet, counters, threads = [], [], []
    for index in range(num_workers):
        counter, control = CommandCounter(), CommandCounter()
        worker = Worker(InstantEngine(InstantConfig(max_num_seqs=16)), counting_client(url, counter),
                        WorkerOptions(name=f"w{index}", served_model_names=[MODEL], block_ms=200,
                                      prefix_affinity_wait=0.0, drain_seconds=5))
        for name in ("refresh", "read", "with_pending"):
            setattr(worker.streams, name, count_into(getattr(worker.streams, name), counter, control))
        worker.batch_lane.fair_share.charge = started.watch(worker.batch_lane.fair_share.charge)
        thread = threading.Thread(target=worker.work, daemon=True)
        fleet.append(worker), counters.append((counter, control)), threads.append(thread)
        thread.start()
    return fleet, counters, threads


def first_pull_seconds(r: redis.Redis, timeout: float = 30.0) -> float:
    """Enqueue one line of a new tenant; seconds from its enqueue until a worker has pulled it."""
    probe = b'{"custom_id": "probe", "method": "POST", "url": "/v1/completions", "body": {"prompt": [1]}}'
    batch_id = submit(r, lambda: [probe], model=MODEL, tenant="probe").batch_id
    started = time.monotonic()
    stream = keys.batch_stream(MODEL, batch_id, keys.partition_of(batch_id, 0, keys.num_partitions(r)))
    while time.monotonic() - started < timeout:
        groups = r.xinfo_groups(stream) if r.exists(stream) else []
        if not r.exists(stream) or any(int(g["entries-read"] or 0) > 0 for g in groups):
            return time.monotonic() - started
        time.sleep(0.005)
    return float("inf")


def measure(url: str, num_batches: int, args) -> dict:
    r = connect(url)
    for node_client in ([r] if not hasattr(r, "get_nodes") else [r.get_redis_connection(n) for n in r.get_primaries()]):
        node_client.flushall()
    fill(r, num_batches, args.lines, args.tenants)
    started = Started()
    fleet, counters, threads = start_workers(url, args.workers, started)
    time.sleep(1.0)  # joined and pulling
    for counter, control in counters:
        counter.reset(), control.reset()
    started.take()
    steps_before = sum(worker.engine.num_steps for worker in fleet)
    window_started = time.monotonic()
    first_pull = first_pull_seconds(r)
    time.sleep(max(0.0, args.seconds - (time.monotonic() - window_started)))
    seconds = time.monotonic() - window_started
    commands = [counter.reset() for counter, _ in counters]
    control = [control.reset() for _, control in counters]
    served = started.take()
    served.pop("probe", None)
    steps = sum(worker.engine.num_steps for worker in fleet) - steps_before
    for worker in fleet:
        worker.request_stop()
    for thread in threads:
        thread.join(timeout=30)
    total = sum(served.values())
    mean = total / max(1, len(served))
    return {"open_batches": num_batches, "commands_per_worker_s": sum(commands) / len(commands) / seconds,
            "requests_per_s": total / seconds, "commands_per_request": sum(commands) / max(1, total),
            "choosing_commands_per_request": sum(control) / max(1, total),
            "choosing_commands_per_step": sum(control) / max(1, steps),
            "first_pull_s": first_pull, "tenants_served": len(served), "requests_per_tenant": mean,
            "fewest_and_most_per_tenant": [min(served.values(), default=0), max(served.values(), default=0)],
            "fair_share_error": max(abs(count - mean) / mean for count in served.values()) if mean else None}


def print_rows(deployment: str, rows: list[dict]) -> None:
    base = rows[0]["commands_per_worker_s"]
    print(f"\n{deployment}: open batches | commands/worker/s (vs first row) | requests/s | commands/request "
          "(choosing the work) | choosing commands/step | first pull s | fair-share error")
    for row in rows:
        print(f"  {row['open_batches']:>7} | {row['commands_per_worker_s']:8.0f} ({row['commands_per_worker_s'] / base:.2f}x)"
              f" | {row['requests_per_s']:8.1f} | {row['commands_per_request']:6.1f} "
              f"({row['choosing_commands_per_request']:.1f}) | {row['choosing_commands_per_step']:5.1f} | "
              f"{row['first_pull_s']:.3f} | {row['fair_share_error']:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--open", default="10,1000,20000", help="numbers of open batches, comma-separated")
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=15.0,
                        help="the measured window: long enough for ~50 requests a tenant to show the split")
    parser.add_argument("--lines", type=int, default=20000, help="the backlog, split over the open batches")
    parser.add_argument("--no-cluster", action="store_true", help="one Redis only")
    args = parser.parse_args()
    sizes = [int(size) for size in args.open.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        single = RedisServer(Path(folder) / "single").start()
        deployments = [("one Redis", single.url)]
        cluster = None
        if not args.no_cluster:
            cluster = RedisClusterServers(Path(folder) / "cluster", num_masters=3).start()
            deployments.append(("3-master cluster", cluster.url))
        import os  # noqa: PLC0415

        os.environ["KVFLEET_QUEUE_URL"] = single.url  # a cluster's finalize queue lives on a plain Redis
        try:
            for deployment, url in deployments:
                results[deployment] = [measure(url, size, args) for size in sizes]
                print_rows(deployment, results[deployment])
        finally:
            single.kill()
            if cluster is not None:
                cluster.stop()
    print_summary({"benchmark": "control_plane", "tenants": args.tenants, "workers": args.workers,
                   "backlog_lines": args.lines, "results": results})


if __name__ == "__main__":
    main()
