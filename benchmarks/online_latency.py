"""Online latency beside a batch backlog, on one worker.

    python -m benchmarks.online_latency [--batch-requests 1200] [--window 20] [--online-share 0.1]

One worker process (the demo model), the API process and Redis. Three phases, each
measured over the same window:

  batch alone    a backlog of --batch-requests keeps the worker saturated: batch
                 requests/s (the capacity); measured again at the end, as shared
                 hosts drift, and the two averaged
  online, idle   streaming online requests at a fixed rate, --online-share of that
                 capacity, on an idle worker: TTFT and inter-token latency p50/p99
  online + batch the same online load while a fresh backlog saturates the worker:
                 TTFT and ITL again, and batch requests/s

TTFT is measured by the client, from sending the request to its first streamed
token (one chunk per engine step). The worker runs on a core of its own (one torch
thread), as a GPU worker has its device to itself; the API, Redis and this client
share the other cores, so their work does not slow the worker's steps down. Goals: online TTFT p99 under the backlog at most
2x the idle p99; batch throughput with the online traffic at least 85% of batch alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import redis

from benchmarks.common import make_workload, print_summary
from engine.demo_model import demo_config, write_checkpoint
from jobs import backlog, batches, heartbeats
from jobs.local_redis import RedisServer, free_port
from producers.ingest import submit
from workers.processes import ProcessGroup

MODEL = "demo"


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def submit_backlog(r: redis.Redis, num_requests: int, max_tokens: int, seed: int) -> str:
    """Output lengths vary around max_tokens (half to one and a half), as real ones do:
    identical lengths would finish, and admit their successors, in lockstep waves."""
    workload = make_workload(num_requests, 1024, seed=seed, prompt_range=(16, 64),
                             output_range=(max_tokens // 2, max_tokens * 3 // 2))
    lines = [json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": prompt, "max_tokens": length, "temperature": 0, "ignore_eos": True}}
                        ).encode() for i, (prompt, length) in enumerate(zip(workload.prompts, workload.output_lens))]
    submission = submit(r, lambda: lines, model=MODEL)
    assert submission.accepted, submission.report.errors[:3]
    return submission.batch_id


def batch_rate(r: redis.Redis, batch_id: str, window: float) -> float:
    """Batch requests completed per second over the window."""
    before, start = batches.num_counted(r, batch_id), time.perf_counter()
    time.sleep(window)
    return (batches.num_counted(r, batch_id) - before) / (time.perf_counter() - start)


def preemptions(r: redis.Redis) -> int:
    return sum(w.get("preemptions", 0) for w in heartbeats.live_workers(r))


def cancel_and_wait_idle(r: redis.Redis, batch_id: str, timeout: float = 120) -> None:
    batches.transition(r, batch_id, "cancelling")  # the worker aborts it and settles the rest as errors
    deadline = time.monotonic() + timeout
    while True:
        workers = heartbeats.live_workers(r)
        if backlog.totals(r, [MODEL]) == (0, 0) and all(w["running"] == 0 for w in workers):
            return
        assert time.monotonic() < deadline, "the worker did not drain the cancelled backlog"
        time.sleep(0.2)


async def one_online(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    sent = time.perf_counter()
    stamps = []
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - sent, "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": len(stamps)}


async def online_load(base_url: str, rate: float, window: float, max_tokens: int, seed: int) -> dict:
    """Requests at a fixed rate for `window` seconds; their TTFT and ITL."""
    count = max(2, int(rate * window))
    prompts = make_workload(count, 1024, seed=seed, prompt_range=(16, 64)).prompts
    async with httpx.AsyncClient(timeout=600) as client:
        start, tasks = time.perf_counter(), []
        for index, prompt in enumerate(prompts):
            await asyncio.sleep(max(0.0, start + index / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one_online(client, f"{base_url}/v1/completions", prompt, max_tokens)))
        results = await asyncio.gather(*tasks)
    assert all(r["tokens"] == max_tokens for r in results), "an online request ended early"
    ttft = [r["ttft"] for r in results]
    itl = [gap for r in results for gap in r["itl"]]
    return {"requests": len(results), "ttft_p50_ms": 1e3 * percentile(ttft, 50),
            "ttft_p99_ms": 1e3 * percentile(ttft, 99), "itl_p50_ms": 1e3 * percentile(itl, 50),
            "itl_p99_ms": 1e3 * percentile(itl, 99)}


def batch_alone(r: redis.Redis, args, seed: int) -> tuple[float, int]:
    """Batch requests/s of a saturating backlog with no online traffic, and its preemptions."""
    batch_id = submit_backlog(r, args.batch_requests, args.max_tokens, seed=seed)
    time.sleep(args.warmup)
    preempted = preemptions(r)
    rate = batch_rate(r, batch_id, args.window)
    time.sleep(1.5)  # one more heartbeat
    preempted = preemptions(r) - preempted
    cancel_and_wait_idle(r, batch_id)
    return rate, preempted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-requests", type=int, default=1200)
    parser.add_argument("--window", type=float, default=20.0, help="seconds each phase is measured")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of backlog before measuring")
    parser.add_argument("--online-share", type=float, default=0.1, help="online rate as a share of capacity")
    parser.add_argument("--max-tokens", type=int, default=32, help="per request, both lanes")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256,
                        help="the worker's token budget per step: it bounds how long a step of batch "
                             "prefills makes an online request wait (see benchmarks/latency.py)")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="kvfleet-online-bench-"))
    model_dir = str(write_checkpoint(demo_config(), folder / "demo-model"))
    server = RedisServer(folder / "redis").start()
    r = redis.Redis.from_url(server.url)
    group, port = ProcessGroup({**os.environ, "OMP_NUM_THREADS": "1"}), free_port()
    cores = sorted(os.sched_getaffinity(0))
    try:
        worker = group.start("worker", ["workers", "--model", model_dir, "--served-model-name", MODEL, "--redis-url",
                               server.url, "--num-kv-blocks", "1024", "--max-num-seqs", str(args.max_num_seqs),
                               "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--log-level",
                               "WARNING"], folder / "worker.log")
        api = group.start("api", ["producers.api", "--port", str(port), "--redis-url", server.url],
                          folder / "api.log")
        if len(cores) > 1:  # the worker on the last core; everything else on the others
            os.sched_setaffinity(worker.pid, {cores[-1]})
            for pid in (0, api.pid, server.process.pid):
                os.sched_setaffinity(pid, set(cores[:-1]))
        group.wait_for_http(f"http://127.0.0.1:{port}/healthz")
        group.wait_for_model(r, MODEL)
        base_url = f"http://127.0.0.1:{port}"
        asyncio.run(online_load(base_url, 2.0, 1.0, args.max_tokens, seed=99))  # warm-up

        alone_before, preempted_alone = batch_alone(r, args, seed=1)
        online_rate = args.online_share * alone_before
        idle = asyncio.run(online_load(base_url, online_rate, args.window, args.max_tokens, seed=2))

        batch_id = submit_backlog(r, args.batch_requests, args.max_tokens, seed=3)
        time.sleep(args.warmup)
        before, start, preempted = batches.num_counted(r, batch_id), time.perf_counter(), preemptions(r)
        busy = asyncio.run(online_load(base_url, online_rate, args.window, args.max_tokens, seed=2))
        with_online = (batches.num_counted(r, batch_id) - before) / (time.perf_counter() - start)
        time.sleep(1.5)  # one more heartbeat
        preempted_busy = preemptions(r) - preempted
        assert batches.num_counted(r, batch_id) < args.batch_requests, "the backlog ran out: raise --batch-requests"
        cancel_and_wait_idle(r, batch_id)
        alone_after, _ = batch_alone(r, args, seed=4)  # again: a shared host drifts
    finally:
        group.stop(["worker", "api"])
        server.kill()

    alone = (alone_before + alone_after) / 2
    ttft_ratio = busy["ttft_p99_ms"] / idle["ttft_p99_ms"]
    retained = with_online / alone
    print(f"batch alone: {alone_before:.1f} req/s before, {alone_after:.1f} after; online at {online_rate:.2f} "
          f"req/s ({args.online_share:.0%})")
    for name, numbers in (("online, idle worker", idle), ("online + backlog", busy)):
        print(f"{name:>20}: TTFT p50 {numbers['ttft_p50_ms']:.0f} ms  p99 {numbers['ttft_p99_ms']:.0f} ms   "
              f"ITL p50 {numbers['itl_p50_ms']:.0f} ms  p99 {numbers['itl_p99_ms']:.0f} ms")
    print(f"TTFT p99 backlog/idle = {ttft_ratio:.2f} (goal <= 2); batch throughput with online "
          f"{with_online:.1f} req/s = {retained:.0%} of alone (goal >= 85%); preemptions in the window: "
          f"{preempted_alone} alone, {preempted_busy} with online")
    print_summary({"batch_alone_rps": alone, "batch_alone_before_rps": alone_before,
                   "batch_alone_after_rps": alone_after, "batch_with_online_rps": with_online, "batch_retained": retained,
                   "online_rate_rps": online_rate, "online_idle": idle, "online_with_backlog": busy,
                   "ttft_p99_ratio": ttft_ratio, "preemptions_alone": preempted_alone,
                   "preemptions_with_online": preempted_busy, "goals_met": ttft_ratio <= 2 and retained >= 0.85,
                   "settings": vars(args)})


if __name__ == "__main__":
    main()
