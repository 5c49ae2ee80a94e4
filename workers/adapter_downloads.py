"""s3:// LoRA adapters fetched into a local cache, in a thread of their own.

A request naming an adapter that is not local yet parks its entry (workers/lanes.py) while
one download thread fetches the adapter; the worker loop never waits on S3. A download takes
only what kvfleet reads of a PEFT folder, `adapter_config.json` and
`adapter_model.safetensors`, each checked for size (head_object) before a byte comes: no
other key of the bucket is ever written anywhere, and naming a folder that holds many
adapters fetches nothing. It lands in a staging folder, removed if anything fails, and is
moved into place whole. The cache keeps the most recently used adapters within its byte
budget; the rest are evicted, least recently used first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from engine.lora.peft import CONFIG_FILE, WEIGHTS_FILE
from jobs import storage

log = logging.getLogger("kvfleet.worker")
S3_PREFIX = "s3://"
MAX_CONFIG_BYTES = 1024 * 1024
DEFAULT_MAX_ADAPTER_BYTES = 4 * 1024**3  # rank 64 on every projection of a 70B model is ~1.7 GB in fp32
DEFAULT_CACHE_BYTES = 32 * 1024**3
STAGING_PREFIX = ".staging-"
COMPLETE = ".complete"


def within(folder: Path, name: str) -> Path:
    """`folder / name`, refused unless it resolves inside `folder`."""
    path = (folder / name).resolve()
    if not path.is_relative_to(folder.resolve()):
        raise ValueError(f"model: adapter file {name!r} would be written outside the adapter cache")
    return path


def download_adapter(uri: str, cache_dir: Path, max_bytes: int) -> Path:
    """The adapter's two files into a folder of `cache_dir` named by the URI's hash; a folder
    already complete is reused. ValueError naming what is wrong."""
    bucket, _, prefix = uri.removeprefix(S3_PREFIX).partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    target = cache_dir / hashlib.sha256(uri.encode()).hexdigest()[:24]
    if (target / COMPLETE).exists():
        os.utime(target)  # used now: the cache evicts the least recently used
        return target
    client = storage.s3_client()
    sizes = {}
    for name, limit in ((CONFIG_FILE, MAX_CONFIG_BYTES), (WEIGHTS_FILE, max_bytes)):
        try:
            sizes[name] = client.head_object(Bucket=bucket, Key=prefix + name)["ContentLength"]
        except client.exceptions.ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise ValueError(f"model: no {name} under {uri}") from None
            raise
        if sizes[name] > limit:
            raise ValueError(f"model: {uri} has a {name} of {sizes[name]} bytes; at most {limit} are read "
                             f"(--max-lora-bytes)")
    staging = Path(tempfile.mkdtemp(dir=cache_dir, prefix=STAGING_PREFIX))
    try:
        for name in sizes:
            client.download_file(bucket, prefix + name, str(within(staging, name)))
        (staging / COMPLETE).touch()
        if target.exists():  # an earlier download that did not complete
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when it was moved into place
    return target


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())


def evict(cache_dir: Path, budget_bytes: int, keep: Path) -> list[Path]:
    """Remove cached adapters, least recently used first, until the cache fits its budget;
    never `keep` (the one just fetched). Returns what was removed."""
    cached = sorted((folder for folder in cache_dir.iterdir() if (folder / COMPLETE).exists()),
                    key=lambda folder: folder.stat().st_mtime)
    total, removed = sum(folder_bytes(folder) for folder in cached), []
    for folder in cached:
        if total <= budget_bytes:
            break
        if folder != keep:
            total -= folder_bytes(folder)
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


class AdapterDownloads:
    """One thread fetching s3:// adapters; the loop asks `poll` whether one is there yet."""

    def __init__(self, cache_dir: Path, max_bytes: int = DEFAULT_MAX_ADAPTER_BYTES,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.cache_dir, self.max_bytes, self.cache_bytes = cache_dir, max_bytes, cache_bytes
        self.futures: dict[str, Future] = {}
        self.executor: ThreadPoolExecutor | None = None

    def poll(self, uri: str) -> bool:
        """Whether `uri`'s download has ended (fetched, or failed); starts it if it never did."""
        future = self.futures.get(uri)
        if future is None:
            if self.executor is None:
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                for leftover in self.cache_dir.glob(f"{STAGING_PREFIX}*"):  # of a worker killed mid-download
                    shutil.rmtree(leftover, ignore_errors=True)
                self.executor = ThreadPoolExecutor(1, thread_name_prefix="lora-download")
            future = self.futures[uri] = self.executor.submit(self._fetch, uri)
        return future.done()

    def folder(self, uri: str) -> Path:
        """The fetched folder (after `poll` said done); ValueError if the download failed, and the
        next request naming it tries again."""
        future = self.futures[uri]
        try:
            return future.result()
        except ValueError:
            del self.futures[uri]
            raise
        except Exception as error:  # botocore's errors: the request fails, not the worker
            del self.futures[uri]
            raise ValueError(f"model: adapter {uri!r} could not be fetched: {error}") from None

    def _fetch(self, uri: str) -> Path:
        started = time.monotonic()
        folder = download_adapter(uri, self.cache_dir, self.max_bytes)
        for removed in evict(self.cache_dir, self.cache_bytes, keep=folder):
            log.info("lora cache: evicted %s (least recently used, over %d bytes)", removed.name, self.cache_bytes)
        log.info("lora: fetched %s in %.1fs", uri, time.monotonic() - started)
        return folder
