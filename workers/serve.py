"""One command for an OpenAI-compatible server: the API, one worker and the finalizer.

    python -m workers.serve --model DIR [--served-model-name NAME] [--tensor-parallel-size N]
        [--host 127.0.0.1] [--port 8000] [--redis-url URL] [worker and engine options]

Uses --redis-url (or KVFLEET_REDIS_URL) when a Redis answers there, else starts a
redis-server of its own in a temporary folder. Prints the base URL once the worker
serves the model. Ctrl-C or SIGTERM stops everything: the worker drains first (its
in-flight requests finish, up to --drain-seconds) while the API still answers, then
the finalizer, the API and the Redis it started. Every other option goes to the
worker unchanged (`python -m workers --help`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from engine.cpu_runtime import core_plan
from jobs.connection import connect
from workers import __main__ as worker_cli
from workers.processes import ProcessGroup, reachable_redis, start_own_redis

SERVE_ONLY = ("--host", "--port", "--redis-url")


def build_parser() -> argparse.ArgumentParser:
    parser = worker_cli.build_parser()
    parser.prog, parser.description = "python -m workers.serve", __doc__.split("\n\n")[0]
    parser.set_defaults(redis_url=None)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="the API's address")
    server.add_argument("--port", type=int, default=8000, help="the API's port")
    return parser


def worker_argv(argv: list[str]) -> list[str]:
    """The command line without serve's own options, for the worker."""
    forwarded, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in SERVE_ONLY:
            skip = True
        elif not arg.startswith(tuple(f"{option}=" for option in SERVE_ONLY)):
            forwarded.append(arg)
    return forwarded


class Stop(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    model = worker_cli.served_model_names(args)[0]

    received: list[str] = []

    def on_signal(signum, _frame):
        # Kept as well as raised: a raise that lands inside a __del__ is printed and dropped by Python.
        received.append(signal.Signals(signum).name)
        raise Stop(received[0])

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    group, own_redis, exit_code = ProcessGroup(), None, 0
    try:
        # The API, finalizer and Redis off the worker's cores once there are enough of them.
        worker_cpus, service_cpus = core_plan(os.sched_getaffinity(0))
        redis_url = reachable_redis(args.redis_url)
        if redis_url is None:
            own_redis = start_own_redis(Path(tempfile.mkdtemp(prefix="kvfleet-redis-")))
            os.sched_setaffinity(own_redis.process.pid, service_cpus)
            redis_url = own_redis.url
        group.start("worker", ["workers", *worker_argv(argv), "--redis-url", redis_url], cpus=worker_cpus)
        group.start("finalizer", ["workers.finalizer", "--redis-url", redis_url], cpus=service_cpus)
        group.start("api", ["producers.api", "--host", args.host, "--port", str(args.port), "--redis-url", redis_url],
                    cpus=service_cpus)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        group.wait_for_http(f"http://{host}:{args.port}/healthz")
        group.wait_for_model(connect(redis_url), model)
        print(f"kvfleet: serving {model!r} at http://{host}:{args.port}/v1 (redis {redis_url}); "
              "Ctrl-C or SIGTERM stops it", flush=True)
        while not received:
            group.check()
            time.sleep(0.5)
        raise Stop(received[0])
    except Stop as stop:
        print(f"kvfleet: {stop}: draining the worker, then stopping", flush=True)
    except SystemExit as error:  # a child exited, or did not come up
        print(f"kvfleet: {error}; stopping", file=sys.stderr, flush=True)
        exit_code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stop once, whatever arrives now
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        group.stop(["worker", "finalizer", "api"], timeout=args.drain_seconds + 10)
        if own_redis is not None:
            own_redis.kill()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
