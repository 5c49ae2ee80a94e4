"""What the queue costs: the same workload through Redis and one worker process,
and through the engine alone, in the same run.

    python benchmarks/fleet_overhead.py [--num-requests 96]

The fleet time runs from submit to the batch's completed status (output file
written); worker start-up (model load) is excluded, as it is for the engine.
Goal: the fleet reaches at least 95% of engine-only throughput.
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

from benchmarks.common import ensure_model, llama_50m_config, make_workload, print_summary
from engine import LLM, SamplingParams
from jobs import batches, keys
from jobs.local_redis import RedisServer
from producers.ingest import submit


def engine_only(model_dir: str, workload, max_num_seqs: int) -> float:
    llm = LLM(model_dir, max_num_seqs=max_num_seqs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outputs) == workload.num_output_tokens
    return elapsed


def through_fleet(model_dir: str, workload, max_num_seqs: int, folder: Path) -> float:
    server = RedisServer(folder / "redis").start()
    r = redis.Redis.from_url(server.url)
    worker = subprocess.Popen([sys.executable, "-m", "workers", "--model", model_dir, "--served-model-name", "bench",
                               "--redis-url", server.url, "--name", "bench-worker", "--max-num-seqs",
                               str(max_num_seqs), "--log-level", "WARNING"], env=os.environ)
    finalizer = subprocess.Popen([sys.executable, "-m", "workers.finalizer", "--redis-url", server.url],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not r.exists(keys.worker("bench-worker")):
            assert worker.poll() is None, "the worker exited"
            time.sleep(0.1)
        lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                             "body": {"model": "bench", "prompt": prompt, "max_tokens": n, "temperature": 0,
                                      "ignore_eos": True}}).encode()
                 for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens))]
        start = time.perf_counter()
        batch_id = submit(r, lambda: lines, model="bench").batch_id
        while batches.batch_object(r, batch_id)["status"] != "completed":
            assert worker.poll() is None and finalizer.poll() is None, "a fleet process exited"
            time.sleep(0.25)  # polling must not steal the worker's CPU: this machine has two cores
        elapsed = time.perf_counter() - start
        batch = batches.batch_object(r, batch_id)
        assert batch["usage"]["output_tokens"] == workload.num_output_tokens
        return elapsed
    finally:
        for process in (worker, finalizer):
            process.terminate()
            process.wait(timeout=60)
        server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--model-dir", default="out/bench-llama-50m")
    args = parser.parse_args()
    config = llama_50m_config()
    model_dir = ensure_model(args.model_dir, config)
    workload = make_workload(args.num_requests, config.vocab_size, seed=1, prompt_range=(16, 256),
                             output_range=(16, 128))
    engine_seconds = engine_only(model_dir, workload, args.max_num_seqs)
    with tempfile.TemporaryDirectory() as folder:
        fleet_seconds = through_fleet(model_dir, workload, args.max_num_seqs, Path(folder))
    tokens = workload.num_output_tokens
    ratio = engine_seconds / fleet_seconds
    print(f"engine alone: {tokens / engine_seconds:8.1f} output tok/s ({engine_seconds:.1f} s)")
    print(f"fleet:        {tokens / fleet_seconds:8.1f} output tok/s ({fleet_seconds:.1f} s)")
    print(f"fleet / engine throughput: {ratio:.1%}")
    print_summary({"benchmark": "fleet_overhead", "num_requests": args.num_requests, "output_tokens": tokens,
                   "engine_seconds": engine_seconds, "fleet_seconds": fleet_seconds, "fleet_over_engine": ratio})


if __name__ == "__main__":
    main()
