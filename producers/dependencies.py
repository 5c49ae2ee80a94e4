"""What every route handler gets through FastAPI dependencies: the app's services (Redis,
the online stats, the served-model cache, the metrics), the settings read from the
environment, and the check of the caller's API key.

`create_app` (producers/api.py) builds one `Services` and keeps it in `app.state`; the
handlers in producers/routes/ are plain module-level functions that declare what they need.
"""

from __future__ import annotations

import hmac
import os
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import redis
import redis.asyncio
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, Counter

from jobs import heartbeats, online
from jobs.tenants import Caller, key_hash, key_ring_from_env
from producers.errors import APIError
from producers.live_stats import OnlineStats, RateSampler
from producers.token_waits import TokenWaits

DEFAULT_MAX_UPLOAD_BYTES = 200 * 1024 * 1024
# The largest legitimate JSON body: a 1,000,000-token prompt as token ids (~8 MB), or the
# 1,000,000 characters of a prompt or a chat, escaped (\uXXXX: 6 bytes a character at worst).
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
SERVED_CACHE_SECONDS = 1.0
DEFAULT_COLD_START_SECONDS = 300.0
DEFAULT_KNOWN_MODEL_SECONDS = 7 * 86400.0


@dataclass(frozen=True)
class Settings:
    """The API's knobs, from the environment (read per request, so a test may change them)."""

    max_upload_bytes: int
    max_request_bytes: int  # every body but an upload's
    request_timeout: float
    max_online_queue: int
    cold_start_seconds: float  # how long an online request for a scaled-to-zero model waits for a worker
    known_model_seconds: float  # how long after its last worker a model still counts as served

    @classmethod
    def from_env(cls) -> Settings:
        env = os.environ
        return cls(max_upload_bytes=int(env.get("KVFLEET_MAX_UPLOAD_BYTES", DEFAULT_MAX_UPLOAD_BYTES)),
                   max_request_bytes=int(env.get("KVFLEET_MAX_REQUEST_BYTES", DEFAULT_MAX_REQUEST_BYTES)),
                   request_timeout=float(env.get("KVFLEET_REQUEST_TIMEOUT", online.DEFAULT_REQUEST_TIMEOUT)),
                   max_online_queue=int(env.get("KVFLEET_MAX_ONLINE_QUEUE", online.DEFAULT_MAX_ONLINE_QUEUE)),
                   cold_start_seconds=float(env.get("KVFLEET_COLD_START_SECONDS", DEFAULT_COLD_START_SECONDS)),
                   known_model_seconds=float(env.get("KVFLEET_KNOWN_MODEL_SECONDS", DEFAULT_KNOWN_MODEL_SECONDS)))


class ServedModels:
    """What live workers serve, looked up at most once a second (every online request asks)."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.checked_at = 0.0
        self.models: dict[str, Any] = {}

    def get(self) -> dict[str, Any]:
        if time.monotonic() - self.checked_at > SERVED_CACHE_SECONDS:
            self.models, self.checked_at = heartbeats.served_models(self.r), time.monotonic()
        return self.models

    def forget(self) -> None:
        """Look again next time (a model asked for may have just started)."""
        self.checked_at = 0.0


@dataclass
class Services:
    redis: redis.Redis
    async_redis: redis.asyncio.Redis
    served_models: ServedModels
    online_stats: OnlineStats = field(default_factory=OnlineStats)
    batch_rates: RateSampler = field(default_factory=RateSampler)  # the console's rates and ETAs
    metrics_registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    token_waits: TokenWaits = field(init=False)  # online requests held back by their tenant's quota

    def __post_init__(self) -> None:
        self.token_waits = TokenWaits(self.async_redis)
        self.http_requests = Counter("kvfleet:api_requests", "API requests by route, status and tenant",
                                     ["route", "status", "tenant"], registry=self.metrics_registry)


def get_services(request: Request) -> Services:
    return request.app.state.services


def get_redis(request: Request) -> redis.Redis:
    return request.app.state.services.redis


ServicesDep = Annotated[Services, Depends(get_services)]
RedisDep = Annotated[redis.Redis, Depends(get_redis)]
SettingsDep = Annotated[Settings, Depends(Settings.from_env)]
BEARER = HTTPBearer(auto_error=False, description="a key of KVFLEET_API_KEYS, KVFLEET_API_KEY or KVFLEET_ADMIN_KEY, "
                                                  "when the server sets any")


def bearer_token(authorization: str) -> str:
    """The key of an `Authorization: Bearer <key>` header; "" for any other header."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.", "invalid_api_key",
                    kind="authentication_error")


def request_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than {limit} bytes (KVFLEET_MAX_REQUEST_BYTES).",
                    "request_too_large")


def require_caller(request: Request,
                   credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)] = None) -> Caller:
    """Every /v1 route: `Authorization: Bearer <key>` when the server sets keys; the caller's
    tenant (jobs/tenants.py), which decides what it may see. (producers/api.py's KeyFirst has
    refused a wrong key already, before the body was read.)"""
    caller = key_ring_from_env().caller(credentials.credentials if credentials is not None else "")
    if caller is None:
        raise unauthorized()
    request.state.caller, request.state.tenant = caller, caller.tenant.name  # the latter: the metrics' label
    return caller


CallerDep = Annotated[Caller, Depends(require_caller)]


def require_monitor(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)] = None) -> None:
    """/metrics and /queue/{model} (tenant names, every model's backlog): with keys set, only
    Prometheus and KEDA with KVFLEET_METRICS_KEY, or the admin, may read them."""
    token = credentials.credentials if credentials is not None else ""
    ring = key_ring_from_env()
    if ring.is_open:
        return
    metrics_key = os.environ.get("KVFLEET_METRICS_KEY") or ""
    if metrics_key and hmac.compare_digest(key_hash(token), key_hash(metrics_key)):
        return
    caller = ring.caller(token)
    if caller is None or not caller.is_admin:
        raise APIError(401, "This route needs KVFLEET_METRICS_KEY (or the admin key): send "
                            "'Authorization: Bearer <key>'.", "invalid_api_key", kind="authentication_error")


MonitorDep = Depends(require_monitor)
