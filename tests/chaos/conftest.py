"""Real processes for the chaos scenarios: a redis-server with appendfsync always, moto's
S3 server behind a pausable proxy, workers and the finalizer as subprocesses."""

from __future__ import annotations

import time
import uuid

import boto3
import pytest
import redis

from jobs import batches
from jobs.local_redis import RedisServer
from tests.chaos.proxy import PausableProxy
from tests.e2e.fleet import Fleet


@pytest.fixture
def chaos_redis(tmp_path):
    server = RedisServer(tmp_path / "redis", appendfsync="always").start()
    yield server
    server.kill()


@pytest.fixture
def s3_proxy(s3_server):
    proxy = PausableProxy(s3_server.port)
    yield proxy
    proxy.close()


@pytest.fixture
def bucket(s3_server) -> str:
    name = f"chaos-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server.url).create_bucket(Bucket=name)
    return name


@pytest.fixture
def fleet(tiny_llama, chaos_redis, s3_proxy, tmp_path):
    """Workers and the finalizer reach S3 only through the proxy; a hung S3 call gives up after 3 s
    (3 tries: 9 s, well past a 2 s lease)."""
    fleet = Fleet(tiny_llama, chaos_redis.url, tmp_path, env={"KVFLEET_S3_ENDPOINT_URL": s3_proxy.url,
                                                              "KVFLEET_S3_TIMEOUT_SECONDS": "3"})
    yield fleet
    fleet.stop()


@pytest.fixture
def r(chaos_redis) -> redis.Redis:
    return redis.Redis.from_url(chaos_redis.url)


def at_progress(r, batch_id: str, fractions: list[float], fleet: Fleet | None = None, timeout: float = 240):
    """Yield as the batch's counted results pass each of `fractions` of its total, in turn: a
    test sized by what happened, not by how fast this host runs (a moment picked by the clock
    lands after the batch ended on a host twice as fast). Each fraction under 1 is a moment the
    batch is still running."""
    total = batches.batch_object(r, batch_id)["request_counts"]["total"]
    for fraction in sorted(fractions):
        wait_for(lambda fraction=fraction: counted(r, batch_id) >= fraction * total, timeout,
                 f"{fraction:.0%} of the batch", fleet, interval=0.02)
        yield fraction


def wait_for(predicate, timeout: float, what: str, fleet: Fleet | None = None, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except redis.ConnectionError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            logs = {n: fleet.log(n) for n in fleet.processes} if fleet else {}
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(interval)


def counted(r, batch_id: str) -> int:
    counts = batches.batch_object(r, batch_id)["request_counts"]
    return counts["completed"] + counts["failed"]
