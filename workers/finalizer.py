"""Run the RQ worker that assembles finished batches' output files, and the sweep
that makes sure every batch ends (jobs/sweeper.py).

    python -m workers.finalizer [--redis-url URL] [--burst] [--sweep-seconds 2] [--grace-seconds 30]
        [--enqueue-grace-seconds 600]

The same as `rq worker -w jobs.rq_workers.FinalizeWorker --serializer rq.serializers.JSONSerializer
kvfleet-finalize` (jobs are JSON, never pickle), plus a thread that sweeps every open batch: it ends the
ones past their window or cancelled that no worker settles, fails the ones whose enqueue
never finished, and enqueues finalize again for counted batches whose job failed or was
lost (jobs/sweeper.py). Several finalizers may run: RQ hands each job to
one, and a finalize that runs twice writes the files once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

import redis
from rq.serializers import JSONSerializer

from jobs import keys
from jobs.connection import REDIS_URL_HELP, connect
from jobs.finalize import finalize_queue
from jobs.preflight import StartupError, check_startup
from jobs.retention import batch_retention, dead_letter_retention, default_retention
from jobs.rq_workers import FinalizeWorker
from jobs.storage import STORAGE_ERRORS
from jobs.sweeper import DEFAULT_ENQUEUE_GRACE_SECONDS, Sweeper

log = logging.getLogger("kvfleet.finalizer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers.finalizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=keys.default_redis_url(), help=REDIS_URL_HELP)
    parser.add_argument("--burst", action="store_true", help="exit when the queue is empty (no sweep)")
    parser.add_argument("--sweep-seconds", type=float, default=2.0, help="how often to look for stuck batches")
    parser.add_argument("--grace-seconds", type=float, default=30.0,
                        help="how long a counted batch may stay open before finalize is enqueued again, and "
                             "how long workers serving an expired or cancelled batch get to settle it")
    parser.add_argument("--enqueue-grace-seconds", type=float, default=DEFAULT_ENQUEUE_GRACE_SECONDS,
                        help="how long a batch's enqueue may stay unfinished before the batch fails")
    return parser


def run_sweeps(r: redis.Redis, every: float, sweeper: Sweeper, stop: threading.Event) -> None:
    while not stop.wait(every):
        try:
            sweeper.sweep()
        except (redis.RedisError, *STORAGE_ERRORS) as error:  # an outage: the next sweep tries again
            log.warning("sweep failed: %s", error)
        except Exception:  # noqa: BLE001 (the sweep thread must outlive any one surprise)
            log.exception("sweep failed")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ["KVFLEET_REDIS_URL"] = args.redis_url  # what finalize jobs connect to (jobs/finalize.py)
    r = connect(args.redis_url)
    try:
        default_retention()  # the output files it writes take it
        batch_retention(), dead_letter_retention()  # its sweep deletes by them
        check_startup(r)
    except (StartupError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    stop = threading.Event()
    if not args.burst:
        sweeper = Sweeper(r, args.grace_seconds, enqueue_grace_seconds=args.enqueue_grace_seconds)
        threading.Thread(target=run_sweeps, args=(r, args.sweep_seconds, sweeper, stop), daemon=True,
                         name="sweep").start()
    queue = finalize_queue(r)  # on a plain Redis of its own with a cluster (KVFLEET_QUEUE_URL)
    worker = FinalizeWorker([queue], connection=queue.connection, serializer=JSONSerializer)
    try:
        worker.work(burst=args.burst, with_scheduler=False)  # no forked scheduler: see jobs/finalize.py
    finally:
        stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
