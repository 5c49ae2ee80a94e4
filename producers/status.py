"""Batches at a glance: recent ones as a table, one as JSON, or one watched to the end.

    python -m producers.status                      # the most recent batches, a table
    python -m producers.status BATCH_ID [--json]    # one batch: its counts, then its object as JSON
    python -m producers.status BATCH_ID --watch     # a progress bar with an ETA until it ends
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import redis
from tqdm import tqdm

from jobs import batches, keys, outlook
from jobs.connection import REDIS_URL_HELP, connect


def summary(batch: dict, now: float | None = None) -> str:
    """One line: the counts and, while open, the ETA against the deadline (jobs/outlook.py)."""
    counts = batch["request_counts"]
    line = (f"{batch['id']}  {batch['status']}  {counts['completed']} completed, {counts['failed']} failed "
            f"of {counts['total']}")
    return line if batch["status"] in batches.TERMINAL else f"{line}  {due(batch, now or time.time())}"


def due(batch: dict, now: float) -> str:
    """"ETA 4.5m, deadline 2.0h", and AT RISK when the ETA passes the deadline."""
    eta = "—" if batch.get("eta_at") is None else duration(batch["eta_at"] - now)
    risk = "  AT RISK" if batch.get("at_risk") else ""
    return f"ETA {eta}, deadline {duration(batch['expires_at'] - now)}{risk}"


def duration(seconds: float | None) -> str:
    """Seconds as 12s, 4.5m, 2.0h or 3.1d; "—" when unknown (an ETA without a rate)."""
    if seconds is None:
        return "—"
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def table(rows: list[dict], now: float | None = None) -> str:
    """Recent batches, one line each: id, status, model, done/total, failed, age and, while
    open, the ETA against the deadline."""
    now = now or time.time()
    header = ("BATCH", "STATUS", "MODEL", "DONE", "FAILED", "AGE", "DUE")
    lines = [header] + [(b["id"], b["status"], b["model"],
                         f"{b['request_counts']['completed'] + b['request_counts']['failed']}/"
                         f"{b['request_counts']['total']}", str(b["request_counts"]["failed"]),
                         duration(now - b["created_at"]), "" if b["status"] in batches.TERMINAL else due(b, now))
                        for b in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)


def watch(r: redis.Redis, batch_id: str, poll_seconds: float = 0.5, stream=None, force: bool = False) -> dict:
    """Poll until the batch reaches a terminal status, with a progress bar (rate and ETA) of its
    counts on `stream` (stderr). The bar is drawn on a terminal, or always with `force`."""
    stream = stream or sys.stderr
    batch = batches.batch_object(r, batch_id)
    with tqdm(total=batch["request_counts"]["total"], desc=batch_id, unit="req", file=stream,
              disable=not (force or stream.isatty()), dynamic_ncols=True) as progress:
        while True:
            counts = batch["request_counts"]
            progress.total = counts["total"]
            progress.update(counts["completed"] + counts["failed"] - progress.n)
            progress.set_postfix(status=batch["status"], failed=counts["failed"])
            if batch["status"] in batches.TERMINAL:
                return batch
            time.sleep(poll_seconds)
            batch = batches.batch_object(r, batch_id)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m producers.status", description=__doc__.split("\n\n")[0])
    parser.add_argument("batch_id", nargs="?", help="a batch; without one, the most recent batches")
    parser.add_argument("--watch", action="store_true", help="a progress bar with an ETA until the batch ends")
    parser.add_argument("--json", action="store_true", help="only the batch object, as JSON")
    parser.add_argument("--limit", type=int, default=20, help="how many recent batches to list")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between polls with --watch")
    parser.add_argument("--redis-url", default=keys.default_redis_url(), help=REDIS_URL_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(parser, args, connect(args.redis_url))
    except redis.ConnectionError as error:
        print(f"error: cannot reach Redis at {args.redis_url}: {error}", file=sys.stderr)
        return 2


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, r: redis.Redis) -> int:
    if args.batch_id is None:
        if args.watch:
            parser.error("--watch needs a BATCH_ID")
        view = outlook.FleetView(r, batches.load_many)  # the fleet's numbers, read once for the table
        rows = [batches.openai_object(r, fields, view)  # None: listed while being created or deleted
                for fields in batches.load_many(r, batches.list_batch_ids(r, limit=args.limit))
                if fields is not None]
        print(json.dumps(rows) if args.json else table(rows) if rows else "no batches")
        return 0
    try:
        batch = watch(r, args.batch_id, args.interval, force=True) if args.watch \
            else batches.batch_object(r, args.batch_id)
    except batches.BatchNotFound:
        print(f"no batch {args.batch_id!r}", file=sys.stderr)
        return 1
    if not args.json:
        print(summary(batch))
    print(json.dumps(batch, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
