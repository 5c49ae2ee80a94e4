"""Submit a JSONL file of requests as one batch.

    python -m producers.submit FILE.jsonl [--model M] [--endpoint /v1/completions]
        [--output redis|s3://bucket/prefix|file:///dir] [--completion-window 24h]
        [--metadata k=v ...] [--batch-id ID] [--tenant NAME] [--skip-invalid] [--require-worker]
        [--wait] [--json]

Validates the whole file first (streaming). Any invalid line is printed as
FILE:LINE: field: message and nothing is enqueued (exit 1), unless
--skip-invalid, which enqueues the valid lines and records the others as failed
requests. Prints the batch id; --json prints the batch object as the last line.
Re-running with the same --batch-id enqueues nothing twice. When no live worker
serves the batch's model, a warning names the models that live workers do serve;
--require-worker makes that an error (exit 2, nothing enqueued). --tenant files the batch
as that tenant's (its fair share, its console and API view); this command writes to Redis
directly, as the operator, so the tenant's API quotas do not apply to it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import redis
from tqdm import tqdm

from jobs import adapters, batches, heartbeats, keys
from jobs.connection import REDIS_URL_HELP, connect
from jobs.schemas import ENDPOINTS, MAX_REPORTED_ERRORS
from jobs.storage import allowed_outputs, check_output_allowed, default_output, validate_sink
from jobs.tenants import DEFAULT_TENANT, TENANT_NAME
from producers.ingest import submit
from producers.status import watch


class NoWorkerServes(Exception):
    pass


def check_served(r: redis.Redis, model: str, required: bool, tenant: str = DEFAULT_TENANT) -> None:
    """Warn on stderr, or raise NoWorkerServes when required, if no live worker serves `model`
    (for `tenant`: another tenant's adapter is none of its models)."""
    if not adapters.check_access(r, model, tenant):
        raise NoWorkerServes(f"model {model!r} is an adapter of another tenant than {tenant!r}")
    served = heartbeats.served_models(r)
    try:
        if model in served or adapters.resolve(r, model, tenant) is not None:  # or an adapter loaded on demand
            return
    except adapters.AdapterQuotaExceeded as error:
        raise NoWorkerServes(str(error)) from None
    message = (f"no live worker serves model {model!r}; live workers serve: "
               f"{', '.join(repr(m) for m in sorted(served)) or 'none'}")
    if required:
        raise NoWorkerServes(message)
    print(f"warning: {message}. The batch waits in the queue until a worker for it starts.", file=sys.stderr)


def parse_metadata(pairs: list[str]) -> dict[str, str]:
    metadata = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--metadata: expected key=value, got {pair!r}")
        metadata[key] = value
    return metadata


def tenant_argument(value: str) -> str:
    if not TENANT_NAME.match(value):
        raise argparse.ArgumentTypeError("must be 1-64 letters, digits, '_', '.' or '-'")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m producers.submit", description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("--redis-url", default=keys.default_redis_url(), help=REDIS_URL_HELP)
    parser.add_argument("--model", help="served model (stream); default: the first line's body.model")
    parser.add_argument("--endpoint", choices=ENDPOINTS,
                        help="default: the first line's url")
    parser.add_argument("--output", default=default_output(),
                        help="redis | s3://bucket/prefix | file:///dir (default: KVFLEET_DEFAULT_OUTPUT or redis)")
    parser.add_argument("--completion-window", default="24h")
    parser.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--batch-id", type=batch_id_argument,
                        help="letters, digits, '_' and '-'; re-running with the same id enqueues nothing twice")
    parser.add_argument("--tenant", type=tenant_argument, default=DEFAULT_TENANT,
                        help="the tenant the batch belongs to (jobs/tenants.py); default: default")
    parser.add_argument("--skip-invalid", action="store_true")
    parser.add_argument("--require-worker", action="store_true",
                        help="fail (exit 2) instead of warning when no live worker serves the model")
    parser.add_argument("--wait", action="store_true", help="poll until the batch ends")
    parser.add_argument("--json", action="store_true", help="print the batch object as the last line")
    return parser


def batch_id_argument(text: str) -> str:
    try:
        return batches.validate_batch_id(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.isfile(args.file):
        print(f"{args.file}: no such file", file=sys.stderr)
        return 2
    try:
        allowed = allowed_outputs()
        validate_sink(args.output)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        check_output_allowed(args.output, allowed)
    except ValueError as error:  # the same message the API answers with a 400
        print(f"error: {error}", file=sys.stderr)
        return 1
    r = connect(args.redis_url)
    show_bar = sys.stderr.isatty()
    progress = tqdm(desc="enqueue", unit="line", disable=not show_bar, file=sys.stderr)

    def source():
        with open(args.file, "rb") as handle:
            yield from handle

    try:
        submission = submit(r, source, batch_id=args.batch_id, endpoint=args.endpoint, model=args.model,
                            sink=args.output, completion_window=args.completion_window,
                            metadata=parse_metadata(args.metadata), skip_invalid=args.skip_invalid,
                            on_progress=progress.update, tenant=args.tenant,
                            before_enqueue=lambda report: check_served(r, report.model, args.require_worker,
                                                                       args.tenant))
    except NoWorkerServes as error:
        print(f"error: {error}; nothing enqueued", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except redis.ConnectionError as error:
        print(f"error: cannot reach Redis at {args.redis_url}: {error}", file=sys.stderr)
        return 2
    finally:
        progress.close()
    report = submission.report
    for error in report.errors:
        print(f"{args.file}:{error.line_number}: {error.field}: {error.message}", file=sys.stderr)
    if report.num_errors > len(report.errors):
        print(f"... and {report.num_errors - MAX_REPORTED_ERRORS} more invalid lines", file=sys.stderr)
    if not submission.accepted:
        print(f"{report.num_errors} of {report.num_lines} lines invalid; nothing enqueued", file=sys.stderr)
        return 1
    print(submission.batch_id)
    print(f"enqueued {submission.num_enqueued} of {report.num_lines} requests"
          + (f", {report.num_errors} recorded as failed" if report.num_errors else ""), file=sys.stderr)
    batch = watch(r, submission.batch_id) if args.wait else batches.batch_object(r, submission.batch_id)
    if args.json:
        print(json.dumps(batch))
    return 1 if batch["status"] in batches.UNSUCCESSFUL else 0


if __name__ == "__main__":
    sys.exit(main())
