"""Run the RQ worker that assembles finished batches' output files.

    python -m workers.finalizer [--redis-url URL] [--burst]

The same as `rq worker --serializer rq.serializers.JSONSerializer kvfleet-finalize`:
jobs are JSON, never pickle.
"""

from __future__ import annotations

import argparse
import logging
import sys

import redis
from rq import Worker
from rq.serializers import JSONSerializer

from jobs import keys
from jobs.finalize import finalize_queue


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers.finalizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=keys.default_redis_url())
    parser.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level="INFO")
    r = redis.Redis.from_url(args.redis_url)
    worker = Worker([finalize_queue(r)], connection=r, serializer=JSONSerializer)
    worker.work(burst=args.burst, with_scheduler=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
