"""A configuration that cannot work is one line at start-up: the default output that is not
there or cannot be written."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jobs.preflight import StartupError, check_startup


def test_the_default_output_must_exist_and_be_writable(r, tmp_path, monkeypatch, s3_server, s3_bucket):
    monkeypatch.setenv("KVFLEET_DEFAULT_OUTPUT", f"s3://{s3_bucket}/out")
    check_startup(r)
    monkeypatch.setenv("KVFLEET_DEFAULT_OUTPUT", "s3://kvfleet-no-such-bucket/out")
    with pytest.raises(StartupError, match="KVFLEET_DEFAULT_OUTPUT s3://kvfleet-no-such-bucket/out: 404"):
        check_startup(r)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVFLEET_DEFAULT_OUTPUT", f"file://{blocker}/results")  # cannot be made, even by root
    with pytest.raises(StartupError, match="Not a directory"):
        check_startup(r)
    monkeypatch.setenv("KVFLEET_DEFAULT_OUTPUT", f"file://{tmp_path}/results")
    check_startup(r)
    assert (tmp_path / "results").is_dir()
    monkeypatch.setenv("KVFLEET_DEFAULT_OUTPUT", "ftp://x")
    with pytest.raises(StartupError, match="KVFLEET_DEFAULT_OUTPUT: output: expected 'redis'"):
        check_startup(r)


def test_the_api_refuses_to_start_on_a_missing_bucket(redis_server, s3_server, monkeypatch):
    monkeypatch.setenv("KVFLEET_DEFAULT_OUTPUT", "s3://kvfleet-no-such-bucket/out")
    done = subprocess.run([sys.executable, "-m", "producers.api", "--redis-url", redis_server.url, "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: KVFLEET_DEFAULT_OUTPUT s3://kvfleet-no-such-bucket/out:")
