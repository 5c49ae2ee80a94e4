"""Latency under load: Poisson arrivals at 70% of the measured capacity, a mix of
long and short prompts, with chunked prefill on and off.

    python benchmarks/latency.py [--num-requests 64] [--load 0.7]

Capacity is measured first (all requests at once, requests/s). Then requests
arrive by a fixed-seed Poisson process and join the running engine as their time
comes. Reports TTFT and inter-token latency p50/p99 for each setting. Goal: with
chunking on, inter-token p99 at most 2x its p50.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.common import ensure_model, llama_50m_config, print_summary
from engine import EngineConfig, LLMEngine, SamplingParams

SETTINGS = {
    "chunked": {"enable_chunked_prefill": True, "max_num_batched_tokens": 24},
    "unchunked": {"enable_chunked_prefill": False, "max_num_batched_tokens": 1024},
}


def workload(num_requests: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        length = rng.randint(600, 900) if rng.random() < 0.25 else rng.randint(16, 64)  # a quarter are long
        requests.append(([rng.randrange(3, vocab) for _ in range(length)], rng.randint(32, 64)))
    return requests


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def run(model_dir: str, requests, options: dict, arrivals: list[float] | None) -> dict:
    engine = LLMEngine(EngineConfig(model=model_dir, max_num_seqs=64, **options))
    pending = list(enumerate(requests))
    outputs = []
    start = time.monotonic()
    while pending or engine.has_unfinished():
        now = time.monotonic() - start
        while pending and (arrivals is None or arrivals[pending[0][0]] <= now):
            index, (prompt, max_tokens) = pending.pop(0)
            arrival = start + (arrivals[index] if arrivals else 0.0)
            engine.add_request(str(index), prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                  ignore_eos=True, detokenize=False), arrival)
        if engine.has_unfinished():
            outputs += engine.step()
        else:
            time.sleep(min(0.01, max(0.0, arrivals[pending[0][0]] - now)))
    elapsed = time.monotonic() - start
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    itl = [gap for o in outputs for gap in o.metrics.inter_token_latencies]
    return {"seconds": elapsed, "requests_per_s": len(outputs) / elapsed,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--load", type=float, default=0.7, help="arrival rate as a fraction of capacity")
    parser.add_argument("--chunk-budget", type=int, default=SETTINGS["chunked"]["max_num_batched_tokens"],
                        help="max_num_batched_tokens with chunking on (decode tokens included)")
    parser.add_argument("--model-dir", default="out/bench-llama-50m")
    args = parser.parse_args()
    SETTINGS["chunked"]["max_num_batched_tokens"] = args.chunk_budget
    config = llama_50m_config()
    model_dir = ensure_model(args.model_dir, config)
    requests = workload(args.num_requests, config.vocab_size)
    capacity = run(model_dir, requests, SETTINGS["chunked"], None)["requests_per_s"]
    rate = args.load * capacity
    rng = random.Random(1)
    arrivals, clock = [], 0.0
    for _ in requests:
        clock += rng.expovariate(rate)
        arrivals.append(clock)
    results = {name: run(model_dir, requests, options, arrivals) for name, options in SETTINGS.items()}
    print(f"capacity {capacity:.2f} req/s; arrivals at {rate:.2f} req/s ({args.load:.0%}); "
          f"chunk budget {args.chunk_budget} tokens")
    for name, r in results.items():
        print(f"{name:10s} TTFT p50 {r['ttft_p50'] * 1e3:7.0f} ms  p99 {r['ttft_p99'] * 1e3:7.0f} ms   "
              f"ITL p50 {r['itl_p50'] * 1e3:6.1f} ms  p99 {r['itl_p99'] * 1e3:6.1f} ms  "
              f"(p99/p50 {r['itl_p99'] / r['itl_p50']:.2f})")
    print_summary({"benchmark": "latency", "num_requests": args.num_requests, "capacity_requests_per_s": capacity,
                   "arrival_rate": rate, "chunk_budget": args.chunk_budget, "results": results})


if __name__ == "__main__":
    main()
