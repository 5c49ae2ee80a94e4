"""Run one worker: one engine (one GPU or tensor-parallel group) fed from Redis.

    python -m workers --model PATH [--served-model-name NAME [NAME ...]] [--redis-url URL] [--name NAME]
        [engine options: --max-model-len, --num-kv-blocks | --kv-cache-memory, --max-num-seqs, --dtype, ...]
        [--metrics-port PORT] [--lease-seconds S] [--max-deliveries N] [--drain-seconds S] [--drain-mode finish|migrate]
        [--stall-seconds S]

The worker serves the stream of each served model name; the default name is the
--model argument exactly as given, as `vllm serve` does.
"""

from __future__ import annotations

if __name__ == "__main__":  # a CLI start: restart on the chosen malloc before torch loads (stdlib only)
    from workers.allocator import reexec_with_allocator

    reexec_with_allocator()

import argparse  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from engine import create_engine  # noqa: E402
from engine.arg_utils import add_engine_args, engine_config_from_args  # noqa: E402
from engine.cpu_runtime import pin_threads  # noqa: E402
from jobs import keys  # noqa: E402
from jobs.connection import REDIS_URL_HELP, connect  # noqa: E402
from jobs.preflight import StartupError, check_startup  # noqa: E402
from workers.adapter_downloads import DEFAULT_CACHE_BYTES, DEFAULT_MAX_ADAPTER_BYTES  # noqa: E402
from workers.adapters import Adapters, parse_lora_modules  # noqa: E402
from workers.allocator import preloaded_allocator  # noqa: E402
from workers.chat_parsers import add_parser_arguments  # noqa: E402
from workers.health import DEFAULT_STALL_SECONDS, Health, serve, stop_serving  # noqa: E402
from workers.metrics import WorkerMetrics  # noqa: E402
from workers.worker import DRAIN_MODES, Worker, WorkerOptions  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__.split("\n\n")[0])
    add_engine_args(parser)
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--served-model-name", nargs="+",
                       help="model name(s) to serve, one stream each; default: --model exactly as given")
    fleet.add_argument("--redis-url", default=keys.default_redis_url(), help=REDIS_URL_HELP)
    fleet.add_argument("--name", default=f"{socket.gethostname()}-{os.getpid()}", help="consumer name")
    fleet.add_argument("--metrics-port", type=int,
                       help="serve /metrics (Prometheus), /healthz (ready: model loaded, consumer groups joined, "
                            "not draining) and /livez (the loop turns) on this port")
    fleet.add_argument("--stall-seconds", type=float, default=DEFAULT_STALL_SECONDS,
                       help="/livez fails once no loop iteration started for this long")
    fleet.add_argument("--lease-seconds", type=float, default=60.0,
                       help="entries idle longer than this are taken over from dead workers")
    fleet.add_argument("--max-deliveries", type=int, default=3, help="then the entry is dead-lettered")
    fleet.add_argument("--max-requeues", type=int, default=100,
                       help="times an entry may be handed back for lack of room; then it fails with cannot_fit")
    fleet.add_argument("--drain-seconds", type=float, default=30.0,
                       help="SIGTERM: time to finish in-flight work (and, with migrate, to make finished work durable)")
    fleet.add_argument("--drain-mode", choices=DRAIN_MODES, default="finish",
                       help="SIGTERM: finish in-flight work, or migrate it: hand it back at once with checkpoints "
                            "of its tokens, for another worker to continue (spot and preemptible machines)")
    fleet.add_argument("--checkpoint-tokens", type=int, default=16,
                       help="save a running batch request's generated tokens in Redis every this many, so that "
                            "a worker taking it over after a crash continues it; 0: never")
    fleet.add_argument("--prefix-affinity-wait", type=float, default=30.0,
                       help="seconds a batch request forwarded to the worker whose prefix cache holds its prompt's "
                            "prefix may wait there to start (workers/affinity.py); then any worker runs it; "
                            "0: no affinity")
    fleet.add_argument("--shared-prefix-cache", action="store_true",
                       help="let every tenant's requests share cached prompt blocks; then a response's "
                            "cached_tokens tells one tenant whether another sent the same prompt. Default: "
                            "each tenant has its own prefix cache")
    fleet.add_argument("--online-reserve", type=int,
                       help="seats (and their blocks) batch work leaves free for online requests; "
                            "default: one in sixteen of --max-num-seqs, at least one")
    fleet.add_argument("--heartbeat-seconds", type=float, default=1.0,
                       help="how often to heartbeat, renew in-flight leases and check batch status")
    fleet.add_argument("--log-level", default="INFO")
    add_parser_arguments(parser.add_argument_group("chat answers"))
    add_lora_arguments(parser.add_argument_group("LoRA adapters (with --enable-lora)"))
    return parser


def add_lora_arguments(lora: argparse._ArgumentGroup) -> None:
    lora.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                      help="adapters served by name, each a PEFT folder or s3:// URI; a request names one as its "
                           "model (it is listed by GET /v1/models with this model as its parent)")
    lora.add_argument("--lora-resolver", action="append", metavar="PREFIX",
                      help="a request may name an adapter by a folder or s3:// URI under PREFIX (whole path "
                           "segments); it is loaded on first use and belongs to the tenant that named it first. "
                           "'{tenant}' in PREFIX gives each tenant its own folder (jobs/adapters.py). Repeat for "
                           "several prefixes")
    lora.add_argument("--lora-cache-dir", help="where s3:// adapters are downloaded; default: a kvfleet-lora-cache "
                                                "folder in the system's temporary folder")
    lora.add_argument("--lora-cache-bytes", type=int, default=DEFAULT_CACHE_BYTES,
                      help="the download cache's budget; past it the least recently used adapters are evicted")
    lora.add_argument("--max-lora-bytes", type=int, default=DEFAULT_MAX_ADAPTER_BYTES,
                      help="the largest adapter_model.safetensors a worker reads (checked before a byte of it is "
                           "fetched or loaded)")
    lora.add_argument("--lora-wait-seconds", type=float, default=10.0,
                      help="an adapter's queued work waits this long for a worker that holds the adapter before "
                           "any worker loads it (workers/adapters.py)")


def adapters_from_args(args: argparse.Namespace, base_names: list[str]) -> Adapters | None:
    """The LoRA adapters to serve; ValueError for a malformed --lora-modules or a missing --enable-lora."""
    modules = parse_lora_modules(args.lora_modules, base_names)
    if not (modules or args.lora_resolver):
        return None
    if not args.enable_lora:
        raise ValueError("--lora-modules and --lora-resolver need --enable-lora")
    adapters = Adapters(modules, list(args.lora_resolver or []), max_bytes=args.max_lora_bytes,
                        cache_bytes=args.lora_cache_bytes)
    if args.lora_cache_dir:
        adapters.cache_dir = Path(args.lora_cache_dir)
    return adapters


def served_model_names(args: argparse.Namespace) -> list[str]:
    return list(args.served_model_name or [args.model])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.online_reserve is not None and args.online_reserve < 0:
        parser.error("--online-reserve must be >= 0")
    if args.prefix_affinity_wait < 0:
        parser.error("--prefix-affinity-wait must be >= 0")
    if args.checkpoint_tokens < 0:
        parser.error("--checkpoint-tokens must be >= 0")
    try:
        adapters = adapters_from_args(args, served_model_names(args))
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = served_model_names(args)
    r = connect(args.redis_url)
    try:
        check_startup(r)  # before the model loads: a configuration error is one line, at once
    except StartupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    metrics, health = WorkerMetrics(args.name, names[0]), Health(args.stall_seconds)
    # Before the model loads: /livez answers while it does, and /healthz says not ready.
    probes = serve(args.metrics_port, metrics.registry, health) if args.metrics_port else None
    pin_threads(args.device, args.tensor_parallel_size)  # rank 0's share of the cores; other ranks pin theirs
    try:
        engine = create_engine(engine_config_from_args(args))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    options = WorkerOptions(name=args.name, served_model_names=names, lease_seconds=args.lease_seconds,
                            max_deliveries=args.max_deliveries, max_requeues=args.max_requeues,
                            drain_seconds=args.drain_seconds, drain_mode=args.drain_mode,
                            online_reserve=args.online_reserve,
                            checkpoint_tokens=args.checkpoint_tokens, prefix_affinity_wait=args.prefix_affinity_wait,
                            maintain_seconds=args.heartbeat_seconds, adapters=adapters,
                            lora_wait_seconds=args.lora_wait_seconds, shared_prefix_cache=args.shared_prefix_cache,
                            reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser)
    worker = Worker(engine, r, options, metrics, health)
    worker.install_signal_handlers()
    capacity = (f"{engine.num_total_blocks} KV blocks" if engine.task == "generate"
                else f"embeddings, {engine.config.max_num_batched_tokens} tokens a step")
    if adapters is not None:
        capacity += (f"; LoRA adapters {', '.join(map(repr, adapters.modules)) or 'none by name'}, "
                     f"{engine.config.max_loras} at once, resolving {adapters.resolvers or 'no prefix'}")
    logging.getLogger("kvfleet.worker").info("%s: serving %s from %s with %s; %s", args.name,
                                             ", ".join(map(repr, names)), args.redis_url, capacity,
                                             preloaded_allocator())
    try:
        return worker.work()
    finally:
        if probes is not None:
            stop_serving(probes)
        engine.shutdown()  # a tensor-parallel group's other ranks


if __name__ == "__main__":
    sys.exit(main())
