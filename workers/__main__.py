"""Run one worker: one engine (one GPU or tensor-parallel group) fed from Redis.

    python -m workers --model PATH [--served-model-name NAME] [--redis-url URL] [--name NAME]
        [--num-kv-blocks N | --kv-cache-memory 8GiB] [--max-num-seqs N] [--tensor-parallel-size 1]
        [--metrics-port PORT] [--lease-seconds S] [--max-deliveries N] [--drain-seconds S]
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path

import redis

from engine import EngineConfig, LLMEngine
from jobs import keys
from workers.metrics import WorkerMetrics
from workers.worker import Worker, WorkerOptions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    parser.add_argument("--served-model-name", help="stream to serve (the batch's model); default: folder name")
    parser.add_argument("--redis-url", default=keys.default_redis_url())
    parser.add_argument("--name", default=f"{socket.gethostname()}-{os.getpid()}", help="consumer name")
    parser.add_argument("--num-kv-blocks", type=int)
    parser.add_argument("--kv-cache-memory", help="bytes or a size like 8GiB")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton"],
                        help="auto: triton on CUDA; on the CPU the native kernel, else torch")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument("--lease-seconds", type=float, default=60.0,
                        help="entries idle longer than this are taken over from dead workers")
    parser.add_argument("--max-deliveries", type=int, default=3, help="then the entry is dead-lettered")
    parser.add_argument("--drain-seconds", type=float, default=30.0, help="SIGTERM: time to finish in-flight work")
    parser.add_argument("--heartbeat-seconds", type=float, default=1.0,
                        help="how often to heartbeat, renew in-flight leases and check batch status")
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.tensor_parallel_size != 1:
        print("error: --tensor-parallel-size: only 1 is supported so far", file=sys.stderr)
        return 2
    try:
        engine = LLMEngine(EngineConfig(
            model=args.model, num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=args.block_size, dtype=args.dtype, device=args.device,
            attention_backend=args.attention_backend))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model = args.served_model_name or Path(args.model.rstrip("/")).name
    options = WorkerOptions(name=args.name, model=model, lease_seconds=args.lease_seconds,
                            max_deliveries=args.max_deliveries, drain_seconds=args.drain_seconds,
                            maintain_seconds=args.heartbeat_seconds)
    metrics = WorkerMetrics(args.name, model)
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    worker = Worker(engine, redis.Redis.from_url(args.redis_url), options, metrics)
    worker.install_signal_handlers()
    logging.getLogger("kvfleet.worker").info("%s: serving %s from %s with %d KV blocks", args.name, model,
                                             args.redis_url, engine.num_total_blocks)
    return worker.work()


if __name__ == "__main__":
    sys.exit(main())
