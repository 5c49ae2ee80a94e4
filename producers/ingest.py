"""Validate a JSONL request file, then enqueue it: the one path behind both
`producers.submit` and `POST /v1/batches`.

Two streaming passes, so memory stays bounded whatever the file's length:
  1. parse every line, collect errors (up to a cap), and keep an 8-byte digest
     of each custom id; duplicates are found by sorting the digests, and only
     then is the file read again to name their lines;
  2. XADD the valid lines in chunks of keys.PARTITION_LINES, each to its partition's
     stream by one script that also marks the chunk enqueued and adds it to the
     partition's total; so a re-run resumes where a crashed one stopped and never
     enqueues a line twice. The scripts are pipelined, CHUNK_LINES lines a round trip.
     The streams are the batch's own (jobs/queues.py), registered for its model's workers
     first.
     Each window of GROUP_WINDOW_LINES lines goes in prefix-group order
     (jobs/prefixes.py): lines that share a prompt prefix sit together in the stream, so
     one worker tends to pull a whole group and prefill the prefix once. The order is a
     function of the file, so a re-run cuts the same chunks.
The stream entry carries the original line, its number and its prompt's prefix hashes;
workers re-parse the line with the same `jobs.schemas.parse_line`.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import redis

from jobs import backlog, batches, keys, prefixes, queues, tenant_backlog
from jobs.entries import BATCH_ENTRY_FIELDS, BatchEntry
from jobs.recording import record_result
from jobs.results import error_line
from jobs.schemas import COMPLETIONS, ENDPOINTS, MAX_REPORTED_ERRORS, LineError, custom_id_of, parse_line
from jobs.scripts import LuaScript, run_all
from jobs.storage import open_storage, validate_sink
from jobs.tenants import DEFAULT_TENANT, estimated_tokens

CHUNK_LINES = 1000
GROUP_WINDOW_LINES = 4096  # lines put in prefix-group order at once (their text is held meanwhile)

LineSource = Callable[[], Iterable[bytes]]  # opens the file anew for each pass


@dataclass
class Report:
    num_lines: int = 0  # non-blank lines, i.e. requests
    num_errors: int = 0
    errors: list[LineError] = field(default_factory=list)  # the first MAX_REPORTED_ERRORS
    invalid: dict[int, str] = field(default_factory=dict)  # line number -> custom id, for --skip-invalid
    endpoint: str | None = None
    model: str | None = None
    estimated_tokens: int = 0  # of the valid lines, as fair share counts them (jobs/outlook.py)
    tenant: str = DEFAULT_TENANT  # whose lines: their prefix groups are the tenant's own (jobs/prefixes.py)

    def add_error(self, error: LineError, custom_id: str) -> None:
        self.num_errors += 1
        self.invalid[error.line_number] = custom_id
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(error)
            self.errors.sort(key=lambda e: e.line_number)


def _lines(source: LineSource) -> Iterator[tuple[int, bytes]]:
    for line_number, raw in enumerate(source(), start=1):
        if raw.strip():
            yield line_number, raw


def _digest(custom_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(custom_id.encode(), digest_size=8).digest(), "little")


def validate(source: LineSource, endpoint: str | None = None, model: str | None = None) -> Report:
    """Pass 1. The batch's endpoint and model default to the first line's."""
    report = Report(endpoint=endpoint, model=model)
    digests = array("Q")  # custom id digests of the valid lines, 8 bytes each
    for line_number, raw in _lines(source):
        report.num_lines += 1
        try:
            request = parse_line(raw, line_number)
            is_short_form = b'"url"' not in raw
            report.endpoint = report.endpoint or (COMPLETIONS if is_short_form else request.url)
            if not is_short_form and request.url != report.endpoint:
                raise LineError(line_number, "url", f"must match the batch endpoint {report.endpoint}")
            line_model = request.body.get("model")
            report.model = report.model or line_model
            if line_model is not None and line_model != report.model:
                raise LineError(line_number, "body.model", f"must match the batch model {report.model!r}")
            digests.append(_digest(request.custom_id))
        except LineError as error:
            report.add_error(error, custom_id_of(raw, line_number))
    _report_duplicates(source, digests, report)
    if report.num_lines == 0:
        report.add_error(LineError(0, "file", "contains no requests"), "")
    report.endpoint = report.endpoint or COMPLETIONS
    if report.endpoint not in ENDPOINTS:
        report.add_error(LineError(0, "endpoint", f"must be one of {', '.join(ENDPOINTS)}"), "")
    report.model = report.model or "default"
    return report


def _report_duplicates(source: LineSource, digests: array, report: Report) -> None:
    """Every repeat of a custom id after its first line is an error."""
    ordered = np.sort(np.frombuffer(digests, dtype=np.uint64)) if len(digests) else np.empty(0, np.uint64)
    repeated = set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())
    if not repeated:
        return
    seen: set[int] = set()
    for line_number, raw in _lines(source):
        if line_number in report.invalid:
            continue
        custom_id = custom_id_of(raw, line_number)
        digest = _digest(custom_id)
        if digest in repeated:
            if digest in seen:
                report.add_error(LineError(line_number, "custom_id", f"duplicate custom_id {custom_id!r}"),
                                 custom_id)
            seen.add(digest)


@dataclass
class Submission:
    batch_id: str
    report: Report
    num_enqueued: int  # by this call; 0 when re-run on a fully enqueued batch
    accepted: bool = True  # False: invalid lines (without skip_invalid); nothing was created


def submit(r: redis.Redis, source: LineSource, *, batch_id: str | None = None, endpoint: str | None = None,
           model: str | None = None, sink: str = "redis", completion_window: str = "24h",
           metadata: dict[str, str] | None = None, input_file_id: str | None = None, skip_invalid: bool = False,
           on_progress: Callable[[int], None] | None = None,
           before_enqueue: Callable[[Report], None] | None = None, tenant: str = DEFAULT_TENANT,
           output_expires_after: int | None = None) -> Submission:
    """Validate, then create (or resume) the batch and enqueue its valid lines.
    With errors and without skip_invalid, nothing is created or enqueued.
    `before_enqueue` sees the validated report first; what it raises stops the submission."""
    sink = validate_sink(sink)
    batches.parse_window(completion_window)
    batch_id = batches.validate_batch_id(batch_id) if batch_id is not None else batches.new_batch_id()
    report = validate(source, endpoint, model)
    if report.num_errors and (not skip_invalid or report.num_errors == report.num_lines or not report.num_lines):
        return Submission(batch_id, report, 0, accepted=False)
    report.tenant = tenant
    if before_enqueue is not None:
        before_enqueue(report)
    batches.create_batch(r, batch_id, endpoint=report.endpoint, model=report.model, input_file_id=input_file_id,
                         completion_window=completion_window, sink=sink, metadata=metadata, tenant=tenant,
                         output_expires_after=output_expires_after)
    fields = batches.load_fields(r, batch_id)
    batches.set_total(r, batch_id, report.num_lines)
    if fields["status"] == "validating":
        batches.transition(r, batch_id, "in_progress")
    num_valid = report.num_lines - len(report.invalid)
    num_partitions = keys.num_partitions(r)
    queues.register(r, report.model, batch_id, {
        keys.partition_of(batch_id, start, num_partitions) for start in range(0, num_valid, keys.PARTITION_LINES)},
        fields["expires_at"], tenant)
    num_enqueued = _enqueue(r, source, batch_id, report, on_progress=on_progress)
    batches.set_estimated_tokens(r, batch_id, report.estimated_tokens)
    if report.invalid:  # their error lines count in the batch's first partition
        tenant_backlog.add_lines(r, tenant, batch_id, keys.partition_of(batch_id, 0, num_partitions),
                                 len(report.invalid))
        storage = open_storage(sink, r)
        for line_number, custom_id in report.invalid.items():
            error = next((e for e in report.errors if e.line_number == line_number), None)
            message = f"line {line_number}: {error.field}: {error.message}" if error else f"line {line_number}: invalid"
            record_result(r, storage, batch_id, error_line(custom_id, "invalid_request", message))
    batches.mark_enqueued(r, batch_id)
    return Submission(batch_id, report, num_enqueued)


# KEYS: the partition's stream, counts hash and stream-info hash. ARGV: the chunk's marker, this
# submission's id, the number N of fields an entry has, their N names (BATCH_ENTRY_FIELDS), then
# N values per entry. The backlog's summary counts them, in the same step (jobs/backlog.py).
# Returns how many it enqueued: a chunk enqueued already is 0, unless by this same submission
# (the call sent again after its reply was lost: what it enqueued then).
_ENQUEUE_CHUNK = LuaScript(backlog.ACKED_LUA + """
local seen = redis.call('HGET', KEYS[2], ARGV[1])
if seen then
  local by, enqueued = string.match(seen, '^(.*):(%d+)$')
  return by == ARGV[2] and tonumber(enqueued) or 0
end
local n = tonumber(ARGV[3])
local entry, count = {}, 0
for i = 4 + n, #ARGV, n do
  for j = 0, n - 1 do
    entry[2 * j + 1] = ARGV[4 + j]
    entry[2 * j + 2] = ARGV[i + j]
  end
  redis.call('XADD', KEYS[1], '*', unpack(entry))
  count = count + 1
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. ':' .. count)
redis.call('HINCRBY', KEYS[2], 'total', count)
local info = info_of(KEYS[3], KEYS[1])
if info and count > 0 then
  make_ready(KEYS[1], info, count)
  redis.call('HINCRBY', tenant_lines_key(KEYS[1]), info.tenant, count)  -- jobs/tenant_backlog.py
end
return count
""")


def _enqueue(r: redis.Redis, source: LineSource, batch_id: str, report: Report,
             on_progress: Callable[[int], None] | None) -> int:
    """Pass 2: XADD the valid lines, PARTITION_LINES a script, skipping chunks already enqueued."""
    num_partitions = keys.num_partitions(r)
    calls: list = []
    chunk: list = []
    index = num_enqueued = num_pending = 0
    submission_id = uuid.uuid4().hex  # tells this call's chunks from an earlier run's

    def add_chunk() -> None:
        chunk_index = (index - 1) // keys.PARTITION_LINES
        partition = keys.partition_of(batch_id, chunk_index * keys.PARTITION_LINES, num_partitions)
        calls.append((_ENQUEUE_CHUNK, [keys.batch_stream(report.model, batch_id, partition),
                                       keys.partition_counts(batch_id, partition), keys.stream_info(partition)],
                      [f"chunk:{chunk_index}", submission_id, len(BATCH_ENTRY_FIELDS), *BATCH_ENTRY_FIELDS,
                       *chunk]))
        chunk.clear()

    for entry in _grouped_entries(source, batch_id, report):
        index += 1
        chunk += entry.to_fields().values()
        if index % keys.PARTITION_LINES == 0:
            add_chunk()
            num_pending += keys.PARTITION_LINES
        if num_pending >= CHUNK_LINES:
            num_enqueued += _flush(r, calls, report.model, on_progress)
            num_pending = 0
    if chunk:
        add_chunk()
    return num_enqueued + _flush(r, calls, report.model, on_progress)


def _grouped_entries(source: LineSource, batch_id: str, report: Report) -> Iterator[BatchEntry]:
    """The valid lines as stream entries, each window of GROUP_WINDOW_LINES in prefix-group order."""
    window: list[tuple[int, bytes]] = []
    report.estimated_tokens = 0
    for line_number, raw in _lines(source):
        if line_number not in report.invalid:
            window.append((line_number, raw))
        if len(window) == GROUP_WINDOW_LINES:
            yield from _in_group_order(window, batch_id, report)
            window = []
    yield from _in_group_order(window, batch_id, report)


def _in_group_order(window: list[tuple[int, bytes]], batch_id: str, report: Report) -> list[BatchEntry]:
    chains = []
    for _, raw in window:
        line = json.loads(raw)  # valid: pass 1 parsed it
        body = line.get("body", line)
        text = prefixes.prompt_text(body, line.get("url"))
        chains.append(prefixes.prefix_hashes(text, prefixes.salt_of(report.tenant, body)))
        report.estimated_tokens += estimated_tokens(text, body)
    now = time.time()
    return [BatchEntry(batch_id, custom_id_of(window[i][1], window[i][0]), window[i][0], window[i][1].strip(), now,
                       prefix=prefixes.encode(chains[i])) for i in prefixes.group_order(chains)]


def _flush(r: redis.Redis, calls: list, model: str, on_progress) -> int:
    """Run the queued chunk scripts in one round trip (and empty the list)."""
    count = sum(run_all(r, calls))
    calls.clear()
    if count:  # idle workers of the model wake (jobs/backlog.py)
        r.xadd(keys.arrivals(model), {"n": count}, maxlen=backlog.ARRIVALS_MAXLEN, approximate=True)
    if on_progress and count:
        on_progress(count)
    return count
