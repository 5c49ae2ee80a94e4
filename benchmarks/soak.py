"""Soak: many short requests through the whole fleet (2 workers, the finalizer, the API)
while a client polls batch status and per-request results. Looks for what only time
shows: memory that grows, a stream that is never trimmed, throughput that decays.

    python -m benchmarks.soak [--num-requests 20000] [--batch-size 1000] [--workers 2]

Batches go in through the API (Files + Batches, the official `openai` client) with a
folder sink; the demo model answers with max_tokens 2. At each quarter of the
requests it reports the RSS of every process, Redis used_memory, the stream's
length and the quarter's throughput. Goals: RSS growth <= 10% after the first
quarter, stream length bounded, last-quarter throughput >= 90% of the second's.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import redis

from benchmarks.common import print_summary
from engine.demo_model import demo_config, write_checkpoint
from jobs import batches, keys, queues
from jobs.local_redis import RedisServer, free_port

MODEL = "soak"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"soak: timed out waiting for {what}")
        time.sleep(0.1)


def poll_continuously(base_url: str, r: redis.Redis, batch_ids: list[str], stop: threading.Event) -> dict:
    """What a pipeline's client does: status of its batches, and single results as they land."""
    rng, counts = random.Random(0), {"status": 0, "results": 0, "errors": 0}
    with httpx.Client(base_url=base_url, timeout=10) as client:
        while not stop.is_set():
            batch_id = rng.choice(batch_ids)
            counts["status"] += 1
            if client.get(f"/v1/batches/{batch_id}").status_code != 200:
                counts["errors"] += 1
            done = r.srandmember(keys.partition_done(batch_id, 0))  # one Redis: one partition
            if done is not None:
                counts["results"] += 1
                if client.get(f"/v1/batches/{batch_id}/results/{done.decode()}").status_code != 200:
                    counts["errors"] += 1
            time.sleep(0.02)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model-dir", default="out/soak-demo-model")
    args = parser.parse_args()
    if not (Path(args.model_dir) / "model.safetensors").exists():
        write_checkpoint(demo_config(), args.model_dir)
    folder = Path(tempfile.mkdtemp(prefix="kvfleet-soak-"))
    server = RedisServer(folder / "redis").start()
    r = redis.Redis.from_url(server.url)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "KVFLEET_ALLOWED_OUTPUTS": f"file://{folder}/"}  # the folder sink the batches name
    api_port = free_port()
    common = ["--redis-url", server.url]
    processes = {f"worker{i}": subprocess.Popen([
        sys.executable, "-m", "workers", "--model", args.model_dir, "--served-model-name", MODEL, *common,
        "--name", f"soak-{i}", "--num-kv-blocks", "512", "--max-num-seqs", "64", "--log-level", "WARNING"],
        env=env) for i in range(args.workers)}
    processes["finalizer"] = subprocess.Popen([sys.executable, "-m", "workers.finalizer", *common],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    processes["api"] = subprocess.Popen([sys.executable, "-m", "producers.api", "--port", str(api_port), *common],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base_url = f"http://127.0.0.1:{api_port}"
    try:
        wait_until(lambda: all(r.exists(keys.worker(f"soak-{i}")) for i in range(args.workers)), 120, "workers")
        wait_until(lambda: httpx.get(f"{base_url}/healthz").status_code == 200 if processes["api"].poll() is None
                   else sys.exit("soak: the API exited"), 60, "the API")
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
        batch_ids = []
        for start in range(0, args.num_requests, args.batch_size):
            lines = "".join(json.dumps({"custom_id": f"r{i}", "prompt": f"Summarize item {i} of the soak.",
                                        "max_tokens": 2, "temperature": 0, "model": MODEL}) + "\n"
                            for i in range(start, min(start + args.batch_size, args.num_requests)))
            uploaded = client.files.create(file=("soak.jsonl", io.BytesIO(lines.encode())), purpose="batch")
            batch_ids.append(client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                                   completion_window="24h", metadata={"run": "soak"},
                                                   extra_body={"output": f"file://{folder / 'results'}"}).id)
        stop = threading.Event()
        polled: dict = {}
        poller = threading.Thread(target=lambda: polled.update(poll_continuously(base_url, r, batch_ids, stop)))
        poller.start()
        quarters, started, last_time, last_done = [], time.monotonic(), time.monotonic(), 0
        for quarter in range(1, 5):
            target = args.num_requests * quarter // 4
            while True:
                done = sum(batches.num_counted(r, b) for b in batch_ids)
                if done >= target:
                    break
                dead = [name for name, p in processes.items() if p.poll() is not None]
                if dead:
                    raise SystemExit(f"soak: {dead} exited")
                time.sleep(0.2)
            now = time.monotonic()
            quarters.append({
                "quarter": quarter, "done": done, "elapsed_s": now - started,
                "requests_per_s": (done - last_done) / (now - last_time),
                "rss_bytes": {name: rss_bytes(p.pid) for name, p in processes.items()},
                "redis_used_memory": int(r.info("memory")["used_memory"]),
                "stream_length": sum(r.xlen(q.stream) for q in queues.registered(r, [MODEL])),
            })
            last_time, last_done = now, done
            q = quarters[-1]
            print(f"quarter {quarter}: {done} done at {q['elapsed_s']:.0f}s, {q['requests_per_s']:.0f} req/s, "
                  f"stream {q['stream_length']}, redis {q['redis_used_memory'] / 2**20:.1f} MiB, RSS MiB "
                  + ", ".join(f"{n} {v / 2**20:.0f}" for n, v in q["rss_bytes"].items()), flush=True)
        wait_until(lambda: all(batches.batch_object(r, b)["status"] in batches.TERMINAL for b in batch_ids), 120,
                   "every batch to end")
        statuses = [batches.batch_object(r, b)["status"] for b in batch_ids]
        stop.set()
        poller.join()
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        server.kill()
    first, second, last = quarters[0], quarters[1], quarters[3]
    growth = {name: last["rss_bytes"][name] / first["rss_bytes"][name] - 1 for name in first["rss_bytes"]}
    decay = last["requests_per_s"] / second["requests_per_s"]
    print("RSS growth after the first quarter: " + ", ".join(f"{n} {g:+.1%}" for n, g in growth.items())
          + " (goal <= +10%)")
    print(f"stream length by quarter: {[q['stream_length'] for q in quarters]} (bounded: trimmed below the "
          f"oldest pending entry)")
    print(f"last-quarter throughput = {decay:.0%} of the second quarter's (goal >= 90%)")
    print(f"client polls: {polled}")
    print_summary({"benchmark": "soak", "num_requests": args.num_requests, "batches": len(batch_ids),
                   "quarters": quarters, "rss_growth_after_first_quarter": growth,
                   "last_over_second_quarter_throughput": decay, "polls": polled, "statuses": statuses})


if __name__ == "__main__":
    main()
