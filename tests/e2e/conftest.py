"""The fleet of the end-to-end tests: worker and finalizer processes on the tiny Llama."""

from __future__ import annotations

import pytest

from jobs.connection import connect
from jobs.local_redis import RedisClusterServers
from tests.e2e.fleet import Fleet


@pytest.fixture
def fleet(tiny_llama, redis_server, r, tmp_path):
    fleet = Fleet(tiny_llama, redis_server.url, tmp_path)
    fleet.start_finalizer()
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """3 masters with a replica each (replicas make a failover possible)."""
    cluster = RedisClusterServers(tmp_path_factory.mktemp("cluster"), num_masters=3, num_replicas=1).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster(redis_cluster, redis_server, r, monkeypatch):
    """A flushed cluster as every process's Redis; RQ's queue on the plain test Redis."""
    monkeypatch.setenv("KVFLEET_REDIS_URL", redis_cluster.url)
    monkeypatch.setenv("KVFLEET_QUEUE_URL", redis_server.url)
    client = connect(redis_cluster.url)
    client.flushall(target_nodes=client.PRIMARIES)
    yield client
    client.close()
