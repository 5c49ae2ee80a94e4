"""Print a batch object and its counts.

    python -m producers.status BATCH_ID [--watch] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from jobs import batches, keys
from jobs.connection import REDIS_URL_HELP, connect


def summary(batch: dict) -> str:
    counts = batch["request_counts"]
    return (f"{batch['id']}  {batch['status']}  {counts['completed']} completed, {counts['failed']} failed "
            f"of {counts['total']}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m producers.status", description=__doc__.split("\n\n")[0])
    parser.add_argument("batch_id")
    parser.add_argument("--watch", action="store_true", help="print a line per change until the batch ends")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--redis-url", default=keys.default_redis_url(), help=REDIS_URL_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    r = connect(args.redis_url)
    try:
        batch = batches.batch_object(r, args.batch_id)
    except batches.BatchNotFound:
        print(f"no batch {args.batch_id!r}", file=sys.stderr)
        return 1
    last = None
    while args.watch and batch["status"] not in batches.TERMINAL:
        if summary(batch) != last:
            last = summary(batch)
            print(last, flush=True)
        time.sleep(args.interval)
        batch = batches.batch_object(r, args.batch_id)
    print(summary(batch))
    print(json.dumps(batch, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
