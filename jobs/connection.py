"""One way to reach Redis, for every process (API, submit, status, workers, finalizer,
demo): a URL, plus TLS files from the environment.

    redis://[user:password@]host:port/db        plain TCP, with an ACL user if given
    rediss://[user:password@]host:port/db       TLS; redis-py's query parameters work too
                                                (?ssl_cert_reqs=required&ssl_ca_certs=/ca.pem)

KVFLEET_REDIS_CA, KVFLEET_REDIS_CERT and KVFLEET_REDIS_KEY name the CA bundle that
verifies the server and the client certificate and key (mutual TLS) for rediss:// URLs.
"""

from __future__ import annotations

import os

import redis
import redis.asyncio

from jobs.keys import default_redis_url

REDIS_URL_HELP = ("redis://[USER:PASSWORD@]HOST:PORT/DB, or rediss:// for TLS (server CA in KVFLEET_REDIS_CA, "
                  "client certificate and key in KVFLEET_REDIS_CERT and KVFLEET_REDIS_KEY); "
                  "default: KVFLEET_REDIS_URL or redis://localhost:6379/0. The ACL a kvfleet user needs is in the README")
TLS_ENVIRONMENT = {"KVFLEET_REDIS_CA": "ssl_ca_certs", "KVFLEET_REDIS_CERT": "ssl_certfile",
                   "KVFLEET_REDIS_KEY": "ssl_keyfile"}


def _tls_options(url: str, options: dict) -> dict:
    if url.startswith("rediss://"):
        for variable, option in TLS_ENVIRONMENT.items():
            if os.environ.get(variable):
                options.setdefault(option, os.environ[variable])
    return options


def connect(url: str | None = None, **options) -> redis.Redis:
    """A client for `url` (default KVFLEET_REDIS_URL); TLS files from the environment."""
    url = url or default_redis_url()
    return redis.Redis.from_url(url, **_tls_options(url, options))


def connect_async(url: str | None = None, **options) -> redis.asyncio.Redis:
    """The asyncio client for the same URL and TLS files (the API's blocking reads)."""
    url = url or default_redis_url()
    return redis.asyncio.Redis.from_url(url, **_tls_options(url, options))
