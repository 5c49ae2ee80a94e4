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
from pathlib import Path

import httpx

from jobs import batches
from jobs.connection import connect
from jobs.local_redis import RedisServer, free_port
from workers.processes import ProcessGroup, reachable_redis

MODEL_NAME = "demo"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="examples/prompts.jsonl")
    parser.add_argument("--out", default="out")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # The demo is its own operator: its results go to its folder (the processes it starts inherit this).
    os.environ.setdefault("KVFLEET_ALLOWED_OUTPUTS", f"redis,file://{out / 'results'}")
    group = ProcessGroup()
    own_redis = None
    python = [sys.executable, "-m"]

    def start(name: str, command: list[str]) -> None:
        group.start(name, command, out / f"{name}.log")

    try:
        redis_url = reachable_redis(None)
        if redis_url is None:
            own_redis = RedisServer(out / "redis").start()
            redis_url = own_redis.url
        print(f"redis: {redis_url}", flush=True)
        model_dir = out / "demo-model"
        subprocess.run(python + ["engine.demo_model", str(model_dir)], check=True)

        worker_metrics, api_port = free_port(), free_port()
        start("worker", ["workers", "--model", str(model_dir), "--served-model-name", MODEL_NAME,
                         "--redis-url", redis_url, "--name", "demo-worker", "--num-kv-blocks", "512",
                         "--metrics-port", str(worker_metrics), "--drain-seconds", "10"])
        start("finalizer", ["workers.finalizer", "--redis-url", redis_url])
        start("api", ["producers.api", "--port", str(api_port), "--redis-url", redis_url])
        group.wait_for_http(f"http://127.0.0.1:{api_port}/healthz")
        group.wait_for_model(connect(redis_url), MODEL_NAME)
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
        group.stop(["worker", "finalizer", "api"])
        if own_redis is not None:
            own_redis.kill()


if __name__ == "__main__":
    sys.exit(main())
