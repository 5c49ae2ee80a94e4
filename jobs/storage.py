"""Where results and output files live: Redis, S3-compatible object storage, or a
local folder. Chosen per batch by its sink URL:

    redis                      the batch's results hash, files as Redis strings
    s3://bucket/prefix         boto3; endpoint from KVFLEET_S3_ENDPOINT_URL or AWS_ENDPOINT_URL
    file:///absolute/dir       one file per result, written atomically (fsync + rename)

A request's result always lands at the same key, and the first write wins
(`put_result` returns False when a line is there already: Redis HSETNX, an exclusive link
in the folder, S3's If-None-Match). So when two attempts of a request race, the line
stored is the one written first, and recording counts that line (jobs/recording.py).

Errors come in two kinds (`is_permanent_error`): an outage (connection refused, a
timeout, a 5xx, throttling) passes and is retried; a permanent error (a 4xx such as
NoSuchBucket or AccessDenied, a folder we may not write) does not, and ends the
requests or the batch it hits with a `storage_error`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import redis
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from jobs import keys

CHUNK = 1 << 20
DEFAULT_S3_TIMEOUT_SECONDS = 10.0
S3_PUT_THREADS = 8  # result objects written at once when many are settled together (the sweep)
# 4xx codes that S3-compatible stores use for "slow down" or "try again": outages, not verdicts.
RETRYABLE_S3_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                      "TooManyRequests", "RequestLimitExceeded", "ConditionalRequestConflict"}
STORAGE_ERRORS = (BotoCoreError, ClientError, OSError)  # what a storage call raises, outage or verdict
PERMANENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR}


def is_permanent_error(error: BaseException) -> bool:
    """True for storage errors that retrying will not fix; False for outages."""
    if isinstance(error, NoCredentialsError):
        return True  # no credentials: nothing a retry fixes
    if isinstance(error, ClientError):
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        code = error.response.get("Error", {}).get("Code", "")
        return 400 <= int(status) < 500 and int(status) not in (408, 429) and code not in RETRYABLE_S3_CODES
    return isinstance(error, OSError) and error.errno in PERMANENT_ERRNOS


def describe_error(error: BaseException) -> str:
    if isinstance(error, ClientError):
        detail = error.response.get("Error", {})
        return f"{detail.get('Code', 'ClientError')}: {detail.get('Message', error)}"
    return f"{type(error).__name__}: {error}"


def result_name(custom_id: str) -> str:
    return hashlib.sha256(custom_id.encode()).hexdigest() + ".json"


class RedisStorage:
    url = "redis"

    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def check_writable(self) -> None:
        """Results go to the data Redis itself."""

    def put_result(self, batch_id: str, custom_id: str, line: bytes) -> bool:
        return bool(self.r.hsetnx(keys.batch_results(batch_id), custom_id, line))

    def put_results(self, batch_id: str, lines: list[tuple[str, bytes]]) -> list[bool]:
        """put_result of each (custom id, line), in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for custom_id, line in lines:
            pipe.hsetnx(keys.batch_results(batch_id), custom_id, line)
        return [bool(stored) for stored in pipe.execute()] if lines else []

    def iter_results(self, batch_id: str) -> Iterator[bytes]:
        for _, line in self.r.hscan_iter(keys.batch_results(batch_id), count=1000):
            yield line

    def get_result(self, batch_id: str, custom_id: str) -> bytes | None:
        return self.r.hget(keys.batch_results(batch_id), custom_id)

    def delete_results(self, batch_id: str) -> None:
        self.r.delete(keys.batch_results(batch_id))

    def delete_results_of(self, batch_id: str, custom_ids: list[str]) -> None:
        self.r.hdel(keys.batch_results(batch_id), *custom_ids)

    def put_file(self, file_id: str, chunks: Iterable[bytes]) -> str:
        """Each chunk written at its own offset (SETRANGE): a write that redis-py sends again
        after a reply was lost writes the same bytes to the same place, where APPEND would
        add them twice."""
        key = keys.file_content(file_id)
        self.r.delete(key)
        offset = 0
        for chunk in chunks:
            self.r.setrange(key, offset, chunk)
            offset += len(chunk)
        return f"redis:{key}"

    def delete_file(self, location: str) -> None:
        self.r.delete(location.removeprefix("redis:"))

    def read_file(self, location: str) -> Iterator[bytes]:
        key = location.removeprefix("redis:")
        size = self.r.strlen(key)
        for start in range(0, size, CHUNK):
            yield self.r.getrange(key, start, min(start + CHUNK, size) - 1)


class FileStorage:
    def __init__(self, root: str) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"

    def check_writable(self) -> None:
        """Raise OSError unless the folder exists (or can be made) and this process may write there."""
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.root, prefix=".check-"):
            pass

    @contextlib.contextmanager
    def _durable_copy(self, path: Path, chunks: Iterable[bytes]) -> Iterator[str]:
        """The bytes in a temporary file beside `path`, fsynced; removed afterwards."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as handle:
                for chunk in chunks:
                    handle.write(chunk)
                handle.flush()
                os.fsync(handle.fileno())
            yield tmp
        finally:
            Path(tmp).unlink(missing_ok=True)

    def _write_atomically(self, path: Path, chunks: Iterable[bytes]) -> None:
        with self._durable_copy(path, chunks) as tmp:
            os.replace(tmp, path)

    def put_result(self, batch_id: str, custom_id: str, line: bytes) -> bool:
        path = self.root / batch_id / "results" / result_name(custom_id)
        with self._durable_copy(path, [line]) as tmp:
            try:
                os.link(tmp, path)  # atomic, and only where nothing is
            except FileExistsError:
                return False
        return True

    def put_results(self, batch_id: str, lines: list[tuple[str, bytes]]) -> list[bool]:
        return [self.put_result(batch_id, custom_id, line) for custom_id, line in lines]

    def iter_results(self, batch_id: str) -> Iterator[bytes]:
        folder = self.root / batch_id / "results"
        if folder.is_dir():
            for path in sorted(folder.glob("*.json")):
                yield path.read_bytes()

    def get_result(self, batch_id: str, custom_id: str) -> bytes | None:
        path = self.root / batch_id / "results" / result_name(custom_id)
        return path.read_bytes() if path.exists() else None

    def delete_results(self, batch_id: str) -> None:
        shutil.rmtree(self.root / batch_id / "results", ignore_errors=True)

    def delete_results_of(self, batch_id: str, custom_ids: list[str]) -> None:
        for custom_id in custom_ids:
            (self.root / batch_id / "results" / result_name(custom_id)).unlink(missing_ok=True)

    def put_file(self, file_id: str, chunks: Iterable[bytes]) -> str:
        path = self.root / "files" / file_id
        self._write_atomically(path, chunks)
        return f"file://{path}"

    def delete_file(self, location: str) -> None:
        Path(location.removeprefix("file://")).unlink(missing_ok=True)

    def read_file(self, location: str) -> Iterator[bytes]:
        with open(location.removeprefix("file://"), "rb") as handle:
            while chunk := handle.read(CHUNK):
                yield chunk


def s3_client(endpoint_url: str | None = None):
    """A boto3 S3 client on `endpoint_url`, else KVFLEET_S3_ENDPOINT_URL, else AWS's. A hung
    call is bounded (read timeout x attempts), so no lease or loop waits on it for ever."""
    import boto3
    from botocore.config import Config

    endpoint_url = endpoint_url or os.environ.get("KVFLEET_S3_ENDPOINT_URL") or None
    read_timeout = float(os.environ.get("KVFLEET_S3_TIMEOUT_SECONDS", DEFAULT_S3_TIMEOUT_SECONDS))
    return boto3.client("s3", endpoint_url=endpoint_url, config=Config(
        retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=3, read_timeout=read_timeout))


class S3Storage:
    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None) -> None:
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.client = s3_client(endpoint_url)  # leases are renewed while a call waits
        self.is_conditional = True  # first write wins (If-None-Match), unless the store lacks it

    def check_writable(self) -> None:
        """Raise ClientError when the bucket is missing or these credentials may not use it."""
        self.client.head_bucket(Bucket=self.bucket)

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def put_result(self, batch_id: str, custom_id: str, line: bytes) -> bool:
        key = self._key(batch_id, "results", result_name(custom_id))
        if not self.is_conditional:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=line)
            return True
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=line, IfNoneMatch="*")
        except ClientError as error:
            code = error.response.get("Error", {}).get("Code", "")
            if code == "PreconditionFailed":
                return False
            if code != "NotImplemented":
                raise
            self.is_conditional = False  # a store without conditional writes: the last write wins there
            return self.put_result(batch_id, custom_id, line)
        return True

    def put_results(self, batch_id: str, lines: list[tuple[str, bytes]]) -> list[bool]:
        """put_result of each (custom id, line), S3_PUT_THREADS requests at a time."""
        with ThreadPoolExecutor(S3_PUT_THREADS) as pool:
            return list(pool.map(lambda item: self.put_result(batch_id, *item), lines))

    def iter_results(self, batch_id: str) -> Iterator[bytes]:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(batch_id, "results") + "/"):
            for item in page.get("Contents", []):
                yield self.client.get_object(Bucket=self.bucket, Key=item["Key"])["Body"].read()

    def get_result(self, batch_id: str, custom_id: str) -> bytes | None:
        try:
            key = self._key(batch_id, "results", result_name(custom_id))
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def delete_results(self, batch_id: str) -> None:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(batch_id, "results") + "/"):
            found = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if found:  # at most 1,000 a page: one DeleteObjects call's limit
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": found, "Quiet": True})

    def delete_results_of(self, batch_id: str, custom_ids: list[str]) -> None:
        """At most 1,000 ids: one DeleteObjects call's limit."""
        found = [{"Key": self._key(batch_id, "results", result_name(custom_id))} for custom_id in custom_ids]
        self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": found, "Quiet": True})

    def put_file(self, file_id: str, chunks: Iterable[bytes]) -> str:
        key = self._key("files", file_id)
        with tempfile.TemporaryFile() as spool:  # boto3 uploads large files in parts
            for chunk in chunks:
                spool.write(chunk)
            spool.seek(0)
            self.client.upload_fileobj(spool, self.bucket, key)
        return f"s3://{self.bucket}/{key}"

    def delete_file(self, location: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=location.removeprefix(f"s3://{self.bucket}/"))

    def read_file(self, location: str) -> Iterator[bytes]:
        key = location.removeprefix(f"s3://{self.bucket}/")
        yield from self.client.get_object(Bucket=self.bucket, Key=key)["Body"].iter_chunks(CHUNK)


Storage = RedisStorage | FileStorage | S3Storage


def validate_sink(url: str) -> str:
    """Normalize a sink URL or raise ValueError saying what is accepted."""
    parsed = urlparse(url)
    if url == "redis":
        return url
    if ".." in parsed.path.split("/"):
        raise ValueError(f"output: a path with '..' is not accepted, got {url!r}")
    if parsed.scheme == "s3" and parsed.netloc:
        return url.rstrip("/")
    if parsed.scheme == "file" and parsed.path.startswith("/") and not parsed.netloc:
        return url.rstrip("/")
    raise ValueError(f"output: expected 'redis', 's3://bucket/prefix' or 'file:///absolute/dir', got {url!r}")


def default_output(environ: Mapping[str, str] = os.environ) -> str:
    """Where results go when a batch names no output: KVFLEET_DEFAULT_OUTPUT, else redis."""
    return environ.get("KVFLEET_DEFAULT_OUTPUT") or "redis"


def allowed_outputs(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Where the operator lets results go: KVFLEET_ALLOWED_OUTPUTS, comma-separated
    destinations or prefixes (`redis`, `s3://bucket/prefix/`, `file:///srv/results/`);
    unset, only the server's default output (KVFLEET_DEFAULT_OUTPUT, else redis)."""
    listed = environ.get("KVFLEET_ALLOWED_OUTPUTS")
    if listed is None:
        return [validate_sink(default_output(environ))]
    return [validate_sink(item.strip()) for item in listed.split(",") if item.strip()]


def check_output_allowed(url: str, allowed: list[str]) -> str:
    """The normalized sink if it lies within one of the allowed destinations, else ValueError.
    A prefix matches whole path segments: s3://b/team does not allow s3://b/team-other."""
    sink = validate_sink(url)
    if not any(_is_within(sink, prefix) for prefix in allowed):
        raise ValueError(f"output: {url!r} is not an allowed destination; the operator allows "
                         f"{', '.join(allowed) or 'none'} (KVFLEET_ALLOWED_OUTPUTS)")
    return sink


def _is_within(sink: str, prefix: str) -> bool:
    if "redis" in (sink, prefix):
        return sink == prefix
    target, root = urlparse(sink), urlparse(prefix)
    if (target.scheme, target.netloc) != (root.scheme, root.netloc):
        return False
    root_path = root.path.rstrip("/")
    return not root_path or target.path == root_path or target.path.startswith(root_path + "/")


def open_storage(url: str, r: redis.Redis) -> Storage:
    parsed = urlparse(validate_sink(url))
    if parsed.scheme == "s3":
        return S3Storage(parsed.netloc, parsed.path)
    if parsed.scheme == "file":
        return FileStorage(parsed.path)
    return RedisStorage(r)


def result_stores(sink: str, r: redis.Redis) -> list[Storage]:
    """Where a batch's result lines are: its sink, and Redis too for a sink elsewhere (the error
    lines a broken sink could not take are kept there: workers/flush.py)."""
    return [open_storage(sink, r)] + ([] if sink == "redis" else [RedisStorage(r)])


def find_result(sink: str, r: redis.Redis, batch_id: str, custom_id: str) -> bytes | None:
    """One request's result line, wherever it was kept."""
    return next((line for store in result_stores(sink, r) if (line := store.get_result(batch_id, custom_id))
                 is not None), None)
