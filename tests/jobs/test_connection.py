"""One URL form for every process: plain Redis, TLS, and a Redis Cluster."""

from __future__ import annotations

import pytest
import redis
from redis.cluster import RedisCluster

from jobs.connection import _cluster_options, connect, is_cluster_url, queue_connection


def test_cluster_urls_name_every_node_the_credentials_and_tls(monkeypatch):
    monkeypatch.setenv("KVFLEET_REDIS_CA", "/etc/ca.pem")
    nodes, options = _cluster_options("rediss+cluster://kv%40user:p%3Ass@10.0.0.1:7000,10.0.0.2:7001,node3/", {})
    assert nodes == [("10.0.0.1", 7000), ("10.0.0.2", 7001), ("node3", 6379)]
    assert options == {"username": "kv@user", "password": "p:ss", "ssl": True, "ssl_ca_certs": "/etc/ca.pem"}
    nodes, options = _cluster_options("redis+cluster://h:7000/", {})
    assert nodes == [("h", 7000)] and options == {}  # no TLS files without rediss+
    with pytest.raises(ValueError, match="only database 0"):
        _cluster_options("redis+cluster://h:7000/3", {})
    assert is_cluster_url("rediss+cluster://h:1/") and not is_cluster_url("rediss://h:1/0")


def test_a_plain_url_keeps_the_plain_client_and_the_queue_on_it(redis_server):
    client = connect(redis_server.url)
    assert type(client) is redis.Redis and queue_connection(client) is client


def test_a_cluster_needs_a_plain_redis_for_the_queue(monkeypatch):
    cluster = RedisCluster.__new__(RedisCluster)  # no node to reach: only its type matters here
    monkeypatch.delenv("KVFLEET_QUEUE_URL", raising=False)
    with pytest.raises(ValueError, match="set KVFLEET_QUEUE_URL to a plain Redis"):
        queue_connection(cluster)
    monkeypatch.setenv("KVFLEET_QUEUE_URL", "redis+cluster://h:7000/")
    with pytest.raises(ValueError, match="RQ cannot run on a cluster"):
        queue_connection(cluster)
