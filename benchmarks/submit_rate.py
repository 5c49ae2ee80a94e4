"""Validated-and-enqueued lines per second of `producers.submit` on short-form lines.

    python benchmarks/submit_rate.py [--num-lines 100000] [--redis-url URL]

Starts its own redis-server on a free port unless --redis-url is given. Prints the
rate and a JSON summary. Goal: at least 20,000 lines/s on the 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import redis

from benchmarks.common import print_summary
from jobs import keys, queues
from jobs.local_redis import RedisServer
from producers.ingest import submit


def write_file(path: Path, num_lines: int) -> None:
    with open(path, "w") as handle:
        for i in range(num_lines):
            handle.write(json.dumps({"custom_id": f"doc-{i:07d}", "prompt": f"Summarize document number {i}.",
                                     "max_tokens": 64, "temperature": 0}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-lines", type=int, default=100_000)
    parser.add_argument("--redis-url")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = None if args.redis_url else RedisServer(Path(tmp) / "redis").start()
        r = redis.Redis.from_url(args.redis_url or server.url)
        path = Path(tmp) / "requests.jsonl"
        write_file(path, args.num_lines)

        def source():
            with open(path, "rb") as handle:
                yield from handle

        try:
            start = time.perf_counter()
            submission = submit(r, source, model="bench")
            elapsed = time.perf_counter() - start
            assert submission.num_enqueued == args.num_lines == r.xlen(keys.batch_stream("bench",
                                                                                      submission.batch_id))
        finally:
            for queue in queues.registered(r, ["bench"]):
                r.delete(queue.stream)
            if server:
                server.kill()
    rate = args.num_lines / elapsed
    print(f"{args.num_lines} lines validated and enqueued in {elapsed:.2f} s: {rate:,.0f} lines/s")
    print_summary({"benchmark": "submit_rate", "num_lines": args.num_lines, "seconds": elapsed,
                   "lines_per_second": rate})


if __name__ == "__main__":
    main()
