"""s3:// adapters (workers/adapter_downloads.py) against a real S3 endpoint (moto's server):
only the two files kvfleet reads are fetched, nothing is ever written outside the cache,
sizes are checked before a byte comes, a failure leaves nothing behind, the cache keeps
its byte budget by evicting the least recently used, and the loop never waits on a download."""

from __future__ import annotations

import os
import time
from pathlib import Path

import boto3
import pytest

from workers.adapter_downloads import AdapterDownloads, download_adapter, evict

CONFIG = b'{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}'


@pytest.fixture
def bucket(s3_server, s3_bucket):
    return boto3.client("s3", endpoint_url=s3_server.url), s3_bucket


def upload(client, bucket: str, prefix: str, files: dict[str, bytes]) -> str:
    for name, body in files.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}{name}", Body=body)
    return f"s3://{bucket}/{prefix}"


def test_only_the_adapters_two_files_are_fetched_and_nothing_escapes_the_cache(bucket, tmp_path):
    client, name = bucket
    outside = tmp_path / "outside" / "x.pth"
    uri = upload(client, name, "team-b/my-lora/", {"adapter_config.json": CONFIG,
                                                   "adapter_model.safetensors": b"weights",
                                                   "README.md": b"docs", "nested/extra.bin": b"x"})
    # A key with an empty segment: joined naively, its rest is an absolute path outside the cache.
    client.put_object(Bucket=name, Key=f"team-b/my-lora//{outside}", Body=b"import os")
    cache = tmp_path / "cache"
    cache.mkdir()
    folder = download_adapter(uri.rstrip("/"), cache, max_bytes=1024)
    assert sorted(path.name for path in folder.iterdir()) == [".complete", "adapter_config.json",
                                                              "adapter_model.safetensors"]
    assert folder.parent == cache and not outside.exists()
    assert [path.name for path in cache.iterdir()] == [folder.name]  # no staging folder left


def test_sizes_are_checked_before_a_byte_is_fetched_and_a_failure_leaves_nothing(bucket, tmp_path):
    client, name = bucket
    cache = tmp_path / "cache"
    cache.mkdir()
    big = upload(client, name, "big/", {"adapter_config.json": CONFIG, "adapter_model.safetensors": b"w" * 4096})
    with pytest.raises(ValueError, match="adapter_model.safetensors of 4096 bytes; at most 1000"):
        download_adapter(big, cache, max_bytes=1000)
    half = upload(client, name, "half/", {"adapter_config.json": CONFIG})
    with pytest.raises(ValueError, match="no adapter_model.safetensors under"):
        download_adapter(half, cache, max_bytes=1000)
    root = f"s3://{name}"  # a folder of many adapters holds no adapter itself: nothing is copied
    with pytest.raises(ValueError, match="no adapter_config.json under"):
        download_adapter(root, cache, max_bytes=1000)
    assert list(cache.iterdir()) == []


def test_the_cache_evicts_the_least_recently_used_past_its_budget(tmp_path):
    cache = tmp_path / "cache"
    folders = []
    for index in range(4):
        folder = cache / f"adapter-{index}"
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(b"w" * 1000)
        (folder / ".complete").touch()
        os.utime(folder, (1000 + index, 1000 + index))
        folders.append(folder)
    os.utime(folders[0], (2000, 2000))  # used again lately: the most recent
    removed = evict(cache, budget_bytes=2500, keep=folders[3])
    assert sorted(removed) == [folders[1], folders[2]]
    assert sorted(path.name for path in cache.iterdir()) == ["adapter-0", "adapter-3"]


def test_a_download_runs_in_its_thread_while_the_caller_goes_on(bucket, tmp_path, monkeypatch):
    client, name = bucket
    uri = upload(client, name, "slow/", {"adapter_config.json": CONFIG, "adapter_model.safetensors": b"w"})
    import workers.adapter_downloads as module  # noqa: PLC0415

    release = []
    original = module.download_adapter

    def held_download(*args, **kwargs):
        while not release:  # the test says when the "network" answers
            time.sleep(0.01)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "download_adapter", held_download)
    downloads = AdapterDownloads(tmp_path / "cache", max_bytes=1000)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / ".staging-left-by-a-crash").mkdir()
    assert downloads.poll(uri) is False  # started; the loop goes on
    assert not (tmp_path / "cache" / ".staging-left-by-a-crash").exists()
    assert downloads.poll(uri) is False
    release.append(True)
    deadline = time.monotonic() + 30
    while not downloads.poll(uri):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert (Path(downloads.folder(uri)) / "adapter_config.json").read_bytes() == CONFIG
    missing = f"s3://{name}/nothing/"
    while not downloads.poll(missing):
        time.sleep(0.01)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        downloads.folder(missing)
    assert missing not in downloads.futures  # the next request naming it tries again
