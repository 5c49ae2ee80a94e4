"""A batch request as a stream entry: the one definition the ingest script writes and the
worker's batch lane reads (the online entry is jobs/online.py's `OnlineEntry`).

Stream fields are flat strings, so each field is written as text and parsed back by its
type; an entry that does not parse is malformed (the worker dead-letters it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

REQUEUES_FIELD = "requeues"


class MalformedEntry(ValueError):
    """A stream entry whose fields are missing or do not parse."""


@dataclass(frozen=True)
class BatchEntry:
    batch_id: str  # the batch it belongs to
    custom_id: str  # the request's id within the batch
    line_number: int  # its line in the input file (1-based), for error messages
    line: bytes  # the original JSONL line; workers re-validate it with jobs.schemas.parse_line
    enqueued_at: float | None = None  # wall-clock seconds at XADD, for the queue-time metric
    prefix: str = ""  # its prompt's prefix hashes (jobs/prefixes.py), comma-separated
    requeues: int = 0  # how often a worker handed it back for lack of room (on the copies it adds)

    def to_fields(self) -> dict[str, str | bytes]:
        fields = {"batch_id": self.batch_id, "custom_id": self.custom_id, "line_number": str(self.line_number),
                  "line": self.line, "enqueued_at": "" if self.enqueued_at is None else f"{self.enqueued_at:.3f}",
                  "prefix": self.prefix}
        if self.requeues:
            fields[REQUEUES_FIELD] = str(self.requeues)
        return fields

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> BatchEntry:
        try:
            enqueued_at = fields.get(b"enqueued_at", b"")
            return cls(fields[b"batch_id"].decode(), fields[b"custom_id"].decode(), int(fields[b"line_number"]),
                       fields[b"line"], float(enqueued_at) if enqueued_at else None,
                       fields.get(b"prefix", b"").decode(), int(fields.get(REQUEUES_FIELD.encode(), 0)))
        except (KeyError, ValueError, UnicodeDecodeError) as error:
            raise MalformedEntry(f"malformed batch entry: {error!r}") from None


# The fields every entry carries, in the order the ingest script writes them (requeues
# only on a handed-back copy).
BATCH_ENTRY_FIELDS = tuple(f.name for f in dataclasses.fields(BatchEntry) if f.name != "requeues")
