"""One way to reach Redis, for every process (API, submit, status, workers, finalizer,
demo): a URL, plus TLS files from the environment.

    redis://[user:password@]host:port/db        plain TCP, with an ACL user if given
    rediss://[user:password@]host:port/db       TLS; redis-py's query parameters work too
                                                (?ssl_cert_reqs=required&ssl_ca_certs=/ca.pem)
    redis+cluster://[user:password@]host:port[,host:port...]/
    rediss+cluster://...                        a Redis Cluster (redis-py's cluster client), over TLS
                                                with rediss+; any reachable node finds the rest

KVFLEET_REDIS_CA, KVFLEET_REDIS_CERT and KVFLEET_REDIS_KEY name the CA bundle that
verifies the server and the client certificate and key (mutual TLS) for rediss:// URLs.

Retries are set here, explicitly (`RETRY`): a command that failed on a dropped connection or a
timeout is sent again, twice at most, after a short back-off. A write sent again may have run
the first time, so every write kvfleet makes is safe to repeat: online requests are enqueued
once per request id, reply events carry a sequence number the reader deduplicates by,
hand-backs and dead letters happen only with the XACK that removes the entry (Lua scripts),
a file in Redis is written chunk by chunk at each chunk's offset (SETRANGE, never APPEND), a
batch transition carries its call's id (the same call again finds itself done), and a result
recorded twice counts once and still enqueues finalize (tests/jobs/test_retried_writes.py).
Longer outages are the callers' to wait out (the worker loop backs off).
"""

from __future__ import annotations

import os
from functools import cache
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from jobs.keys import default_redis_url

RETRIES = 2
RETRY_BASE_SECONDS, RETRY_CAP_SECONDS = 0.05, 1.0
SOCKET_TIMEOUT_SECONDS = 10.0  # longer than any blocking read kvfleet makes (1 s), shorter than a lease
CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS

REDIS_URL_HELP = ("redis://[USER:PASSWORD@]HOST:PORT/DB, rediss:// for TLS (server CA in KVFLEET_REDIS_CA, "
                  "client certificate and key in KVFLEET_REDIS_CERT and KVFLEET_REDIS_KEY); "
                  "redis+cluster://HOST:PORT[,HOST:PORT...]/ (or rediss+cluster://) for a Redis Cluster; "
                  "default: KVFLEET_REDIS_URL or redis://localhost:6379/0. The ACL a kvfleet user needs is in the README")
TLS_ENVIRONMENT = {"KVFLEET_REDIS_CA": "ssl_ca_certs", "KVFLEET_REDIS_CERT": "ssl_certfile",
                   "KVFLEET_REDIS_KEY": "ssl_keyfile"}


def _tls_options(url: str, options: dict) -> dict:
    if url.startswith(("rediss://", "rediss+cluster://")):
        for variable, option in TLS_ENVIRONMENT.items():
            if os.environ.get(variable):
                options.setdefault(option, os.environ[variable])
    return options


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0] in CLUSTER_SCHEMES


def _cluster_options(url: str, options: dict) -> tuple[list[tuple[str, int]], dict]:
    """(host, port) of each node the URL names, and the client options."""
    parts = urlsplit(url)
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0, not {parts.path.strip('/')!r}")
    credentials, _, hosts = parts.netloc.rpartition("@")
    user, _, password = credentials.partition(":") if credentials else ("", "", "")
    nodes = []
    for host_port in hosts.split(","):
        host, _, port = host_port.rpartition(":") if ":" in host_port else (host_port, "", "")
        nodes.append((host or "localhost", int(port or 6379)))
    options = _tls_options(url, dict(options))
    if user or password:
        options.update(username=unquote(user) or None, password=unquote(password) or None)
    if CLUSTER_SCHEMES[parts.scheme]:
        options["ssl"] = True
    return nodes, options


def _retry_options(options: dict, retry_class) -> dict:
    options = dict(options)
    options.setdefault("retry", retry_class(ExponentialWithJitterBackoff(base=RETRY_BASE_SECONDS,
                                                                        cap=RETRY_CAP_SECONDS), RETRIES,
                                            supported_errors=(redis.ConnectionError, redis.TimeoutError)))
    options.setdefault("socket_timeout", SOCKET_TIMEOUT_SECONDS)
    options.setdefault("socket_connect_timeout", SOCKET_TIMEOUT_SECONDS)
    return options


def connect(url: str | None = None, **options) -> redis.Redis | RedisCluster:
    """A client for `url` (default KVFLEET_REDIS_URL); TLS files from the environment.
    A redis+cluster:// URL gives redis-py's cluster client (MOVED, failover and retries are its job)."""
    url = url or default_redis_url()
    options = _retry_options(options, Retry)
    if is_cluster_url(url):
        nodes, options = _cluster_options(url, options)
        return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in nodes], **options)
    return redis.Redis.from_url(url, **_tls_options(url, options))


def connect_async(url: str | None = None, **options) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
    """The asyncio client for the same URL and TLS files (the API's blocking reads)."""
    url = url or default_redis_url()
    options = _retry_options(options, AsyncRetry)
    if is_cluster_url(url):
        nodes, options = _cluster_options(url, options)
        return redis.asyncio.RedisCluster(
            startup_nodes=[redis.asyncio.cluster.ClusterNode(host, port) for host, port in nodes], **options)
    return redis.asyncio.Redis.from_url(url, **_tls_options(url, options))


def queue_connection(r: redis.Redis | RedisCluster) -> redis.Redis:
    """The Redis of the finalize queue (RQ): the data Redis itself, except with a cluster,
    where RQ cannot run: then the plain Redis that KVFLEET_QUEUE_URL names."""
    if not isinstance(r, RedisCluster):
        return r
    url = os.environ.get("KVFLEET_QUEUE_URL")
    if not url or is_cluster_url(url):
        raise ValueError("with a Redis Cluster, set KVFLEET_QUEUE_URL to a plain Redis (redis:// or rediss://) "
                         "for the finalize queue: RQ cannot run on a cluster")
    return _queue_client(url)


@cache
def _queue_client(url: str) -> redis.Redis:
    return connect(url)
