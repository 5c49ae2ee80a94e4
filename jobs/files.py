"""File objects of the OpenAI Files API: metadata in a Redis hash, content in the
storage that holds it (input uploads in Redis, outputs in the batch's sink)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import redis

from jobs import keys, retention
from jobs.storage import Storage, open_storage, result_stores
from jobs.tenants import DEFAULT_TENANT, Caller

LIST_PAGE = 500
RESULTS_PAGE = 1000  # results deleted per call: one S3 DeleteObjects' limit
log = logging.getLogger(__name__)


class FileNotFound(KeyError):
    pass


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def create_file(r: redis.Redis, storage: Storage, chunks: Iterable[bytes], filename: str, purpose: str,
                file_id: str | None = None, tenant: str = DEFAULT_TENANT, expires_after: int | None = None,
                batch_id: str | None = None) -> dict[str, Any]:
    """Store the content, then the object, owned by `tenant`, expiring `expires_after` seconds
    after its creation (else by KVFLEET_DEFAULT_RETENTION: jobs/retention.py); `batch_id`: the
    batch whose output or error file it is (its results expire with it)."""
    file_id = file_id or new_file_id()
    size = 0

    def counted() -> Iterator[bytes]:
        nonlocal size
        for chunk in chunks:
            size += len(chunk)
            yield chunk

    location = storage.put_file(file_id, counted())
    created = time.time()
    expires_at = retention.expiry_of(expires_after, created)
    r.hset(keys.file(file_id), mapping={"id": file_id, "bytes": size, "created_at": int(created),
                                         "filename": filename, "purpose": purpose, "location": location,
                                         "sink": storage.url, "tenant": tenant, "batch_id": batch_id or "",
                                         "expires_at": expires_at or ""})
    pipe = r.pipeline(transaction=False)  # after the hash: a listed id always has one
    pipe.zadd(keys.FILES, {file_id: created})
    pipe.zadd(keys.tenant_files(tenant), {file_id: created})
    retention.schedule(pipe, file_id, expires_at)
    pipe.execute()
    return file_object(r, file_id)


def list_files(r: redis.Redis, purpose: str | None = None, after: str | None = None, limit: int = 10_000,
               order: str = "desc", tenant: str | None = None) -> tuple[list[dict[str, Any]], bool]:
    """OpenAI's file list: (objects, has_more), newest first unless `order` is "asc"; `after` is
    the id where the previous page ended. Only `tenant`'s files, unless None (every tenant's)."""
    is_desc = order == "desc"
    index = keys.FILES if tenant is None else keys.tenant_files(tenant)
    start = 0
    if after:
        rank = r.zrevrank(index, after) if is_desc else r.zrank(index, after)
        if rank is None:
            raise FileNotFound(after)
        start = rank + 1
    found: list[dict[str, Any]] = []
    page = LIST_PAGE
    while len(found) <= limit:
        ids = (r.zrevrange if is_desc else r.zrange)(index, start, start + page - 1)
        if not ids:
            break
        start += len(ids)
        for file_id in ids:
            try:
                info = file_object(r, file_id.decode())
            except FileNotFound:
                continue  # deleted meanwhile
            if purpose is None or info["purpose"] == purpose:
                found.append(info)
    return found[:limit], len(found) > limit


def delete_file(r: redis.Redis, file_id: str) -> dict[str, Any]:
    """Remove the file's content from the storage that holds it (Redis, the folder, the bucket),
    then its object; OpenAI's deletion object. A batch's output or error file takes the
    per-request results of its lines with it, from every store that holds them, first: after
    the delete, GET /v1/batches/{id}/results/{custom_id} finds none of them either."""
    storage, location = _stored_at(r, file_id)
    tenant, batch_id, sink = r.hmget(keys.file(file_id), "tenant", "batch_id", "sink")
    if batch_id:
        delete_results_of_lines(r, batch_id.decode(), sink.decode(), read_lines(r, file_id))
    storage.delete_file(location)
    pipe = r.pipeline(transaction=False)
    pipe.delete(keys.file(file_id))
    pipe.zrem(keys.FILES, file_id)
    pipe.zrem(keys.tenant_files(tenant.decode() if tenant else DEFAULT_TENANT), file_id)
    pipe.zrem(keys.EXPIRING_FILES, file_id)
    pipe.execute()
    return {"id": file_id, "object": "file", "deleted": True}


def delete_results_of_lines(r: redis.Redis, batch_id: str, sink: str, lines: Iterable[bytes]) -> None:
    """Delete the per-request results of the custom ids these result lines name, a page at a time."""
    stores, page = result_stores(sink, r), []
    for line in lines:
        if line.strip():
            page.append(json.loads(line)["custom_id"])
        if len(page) == RESULTS_PAGE:
            for store in stores:
                store.delete_results_of(batch_id, page)
            page = []
    for store in stores:
        if page:
            store.delete_results_of(batch_id, page)


def file_object(r: redis.Redis, file_id: str) -> dict[str, Any]:
    """OpenAI's file object; FileNotFound for a file past its expiry (the sweep deletes it)."""
    return _as_object(file_id, _live_fields(r, file_id))


def owned_file(r: redis.Redis, file_id: str, caller: Caller) -> dict[str, Any]:
    """The file object, if the caller may see it; FileNotFound as if absent otherwise."""
    fields = _live_fields(r, file_id)
    if not caller.owns(fields.get("tenant")):  # none: made before tenants existed
        raise FileNotFound(file_id)
    return _as_object(file_id, fields)


def _live_fields(r: redis.Redis, file_id: str) -> dict[str, str]:
    """The file's hash, decoded; FileNotFound if there is none or it is past its expiry."""
    raw = r.hgetall(keys.file(file_id))
    if not raw:
        raise FileNotFound(file_id)
    fields = {k.decode(): v.decode() for k, v in raw.items()}
    if fields.get("expires_at") and int(fields["expires_at"]) <= time.time():
        raise FileNotFound(file_id)
    return fields


def _as_object(file_id: str, f: dict[str, str]) -> dict[str, Any]:
    return {"id": file_id, "object": "file", "bytes": int(f["bytes"]), "created_at": int(f["created_at"]),
            "expires_at": int(f["expires_at"]) if f.get("expires_at") else None, "filename": f["filename"],
            "purpose": f["purpose"], "status": "processed"}


def read_lines(r: redis.Redis, file_id: str) -> Iterator[bytes]:
    """The file's lines, without their newlines, read chunk by chunk (any size of file)."""
    buffer = b""
    for chunk in read_file(r, file_id):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        yield from lines
    if buffer:
        yield buffer


def read_file(r: redis.Redis, file_id: str) -> Iterator[bytes]:
    storage, location = _stored_at(r, file_id)
    return storage.read_file(location)


def _stored_at(r: redis.Redis, file_id: str) -> tuple[Storage, str]:
    """The storage that holds the file's content, and where in it."""
    location, sink = r.hmget(keys.file(file_id), "location", "sink")
    if location is None:
        raise FileNotFound(file_id)
    return open_storage(sink.decode(), r), location.decode()


def delete_expired(r: redis.Redis, now: float | None = None) -> list[str]:
    """Delete the files past their expiry (a batch's output or error file takes the batch's
    results with it); returns their ids."""
    now = time.time() if now is None else now
    due = [member.decode() for member in
           r.zrangebyscore(keys.EXPIRING_FILES, "-inf", now, start=0, num=retention.SWEEP_BATCH)]
    for file_id in due:
        try:
            delete_file(r, file_id)  # as its owner would: its lines' results go with it
        except FileNotFound:
            pass  # deleted meanwhile by its owner
        except (redis.ConnectionError, redis.TimeoutError):
            raise  # an outage: the next sweep tries again
        except Exception:  # noqa: BLE001 (a bucket that is gone must not stop the sweep)
            log.exception("file %s: could not delete it at its expiry; trying again at the next sweep", file_id)
            continue
        r.zrem(keys.EXPIRING_FILES, file_id)
    return due
