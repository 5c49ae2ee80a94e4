"""`make demo`: the whole fleet on this machine, on embedded defaults.

    python -m workers.demo [--prompts examples/prompts.jsonl] [--out out]

Uses KVFLEET_REDIS_URL if it answers, else starts a redis-server of its own; builds
the demo model; starts a worker, the finalizer and the API; submits the prompts
with --wait; writes the results under OUT/ and says where; stops everything it
started, whatever happens.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

from jobs import batches, heartbeats
from jobs.connection import connect
from jobs.local_redis import RedisServer, free_port

MODEL_NAME = "demo"


def reachable_redis() -> str | None:
    url = os.environ.get("KVFLEET_REDIS_URL")
    if not url:
        return None
    try:
        connect(url, socket_connect_timeout=1).ping()
        return url
    except redis.RedisError:
        print(f"KVFLEET_REDIS_URL={url} does not answer; starting a local redis-server", flush=True)
        return None


def wait_for_http(url: str, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{process.args} exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not come up")


def wait_for_worker(r: redis.Redis, process: subprocess.Popen, timeout: float = 180) -> None:
    """Until the worker heartbeats its model (it loads the model first), so submit finds it."""
    deadline = time.monotonic() + timeout
    while MODEL_NAME not in heartbeats.served_models(r):
        if process.poll() is not None:
            raise SystemExit(f"the worker exited with {process.returncode}; see its log")
        if time.monotonic() > deadline:
            raise SystemExit("the worker did not start")
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="examples/prompts.jsonl")
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    processes: list[subprocess.Popen] = []
    own_redis = None
    python = [sys.executable, "-m"]

    def start(name: str, command: list[str]) -> subprocess.Popen:
        log = open(out / f"{name}.log", "wb")  # noqa: SIM115 (kept open for the process's life)
        process = subprocess.Popen(python + command, stdout=log, stderr=subprocess.STDOUT)
        processes.append(process)
        return process

    try:
        redis_url = reachable_redis()
        if redis_url is None:
            own_redis = RedisServer(out / "redis").start()
            redis_url = own_redis.url
        print(f"redis: {redis_url}", flush=True)
        model_dir = out / "demo-model"
        subprocess.run(python + ["engine.demo_model", str(model_dir)], check=True)

        worker_metrics, api_port = free_port(), free_port()
        worker = start("worker", ["workers", "--model", str(model_dir), "--served-model-name", MODEL_NAME,
                         "--redis-url", redis_url, "--name", "demo-worker", "--num-kv-blocks", "512",
                         "--metrics-port", str(worker_metrics), "--drain-seconds", "10"])
        start("finalizer", ["workers.finalizer", "--redis-url", redis_url])
        api = start("api", ["producers.api", "--port", str(api_port), "--redis-url", redis_url])
        wait_for_http(f"http://127.0.0.1:{api_port}/healthz", api)
        wait_for_worker(connect(redis_url), worker)
        print(f"api: http://127.0.0.1:{api_port}/v1   worker metrics: http://127.0.0.1:{worker_metrics}/metrics",
              flush=True)

        submitted = subprocess.run(python + ["producers.submit", args.prompts, "--redis-url", redis_url,
                                             "--model", MODEL_NAME, "--output", f"file://{out / 'results'}",
                                             "--wait"], stdout=subprocess.PIPE, text=True)
        batch_id = submitted.stdout.split()[0] if submitted.stdout.strip() else None
        if submitted.returncode != 0 or batch_id is None:
            print("submit failed; see the messages above and the logs under " + str(out), file=sys.stderr)
            return 1
        r = connect(redis_url)
        batch = batches.batch_object(r, batch_id)
        counts = batch["request_counts"]
        print(f"batch {batch_id}: {batch['status']}, {counts['completed']} completed, {counts['failed']} failed")
        for kind in ("output", "error"):
            file_id = batch[f"{kind}_file_id"]
            if file_id:
                content = httpx.get(f"http://127.0.0.1:{api_port}/v1/files/{file_id}/content", timeout=30).content
                path = out / f"{kind}.jsonl"
                path.write_bytes(content)
                print(f"{kind} lines: {path}")
        print(f"per-request results: {out / 'results' / batch_id / 'results'}; logs: {out}/*.log")
        return 0 if batch["status"] == "completed" else 1
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        if own_redis is not None:
            own_redis.kill()


if __name__ == "__main__":
    sys.exit(main())
