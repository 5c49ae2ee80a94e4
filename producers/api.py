"""OpenAI-compatible API (FastAPI + uvicorn): online completions, Files and Batches.

    python -m producers.api [--host 127.0.0.1] [--port 8000] [--redis-url URL]

Routes, one router module each under producers/routes/:
  online.py    POST /v1/completions and /v1/chat/completions (through the queue)
  embeddings.py  POST /v1/embeddings (through the queue; one answer, never streamed)
  models.py    GET /v1/models (what live workers serve), GET /v1/models/{model}
  files.py     POST /v1/files, GET /v1/files/{id}, GET /v1/files/{id}/content
  batches.py   POST /v1/batches, GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel,
               and beyond OpenAI GET /v1/batches/{id}/results/{custom_id}
  health.py    GET /healthz, GET /metrics
  console.py   the operator console under /ui
With keys set (KVFLEET_API_KEYS, KVFLEET_API_KEY, KVFLEET_ADMIN_KEY: jobs/tenants.py), every
/v1 route needs `Authorization: Bearer <key>`, and a key's tenant sees only its own files and
batches (another's are 404); the key is checked before the body is read. Errors use OpenAI's
{"error": {...}} shape (producers/errors.py). Uploads stream to storage in 1 MiB chunks and stop at
KVFLEET_MAX_UPLOAD_BYTES; every other body stops at KVFLEET_MAX_REQUEST_BYTES (413; a
Content-Length over it is refused before the body is read). CORS is off unless
KVFLEET_CORS_ORIGINS lists the allowed origins.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import redis
import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.datastructures import Headers
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobs import keys, tenants
from jobs.connection import REDIS_URL_HELP, connect, connect_async
from jobs.preflight import StartupError, check_startup
from jobs.retention import default_retention
from jobs.tenants import key_ring_from_env
from producers.dependencies import (
    ServedModels,
    Services,
    Settings,
    bearer_token,
    request_too_large,
    unauthorized,
)
from producers.errors import error_response, install_error_handlers, openai_style_schema
from producers.routes import batches, console, embeddings, files, health, models, online
from producers.routes.files import file_too_large

log = logging.getLogger("kvfleet.api")
MULTIPART_OVERHEAD_BYTES = 64 * 1024  # room for the form's other fields and boundaries


def create_app(redis_url: str | None = None) -> FastAPI:
    key_ring_from_env()  # a malformed KVFLEET_API_KEYS stops the start, naming the entry
    default_retention()  # and so does a malformed KVFLEET_DEFAULT_RETENTION
    r = connect(redis_url)
    _publish_weights(r)
    app = FastAPI(title="kvfleet", description="OpenAI-compatible online completions, Files and Batches API")
    app.state.services = services = Services(r, connect_async(redis_url), ServedModels(r))
    app.state.metrics_registry = services.metrics_registry
    for router in (online.router, embeddings.router, models.router, files.router, batches.router, health.router, console.public,
                   console.router):
        app.include_router(router)
    install_error_handlers(app)
    app.add_exception_handler(console.LoginRequired, console.to_login)
    cors_origins = [o.strip() for o in os.environ.get("KVFLEET_CORS_ORIGINS", "").split(",") if o.strip()]
    if cors_origins:  # off by default: browsers on other origins may not call the API
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(BodyLimit)
    app.add_middleware(KeyFirst)  # outside the body limit: no key, no body read at all
    app.add_middleware(CountRequests)
    app.openapi = lambda: openai_style_schema(app)
    return app


def _publish_weights(r) -> None:
    """The tenants' fair-share weights, for the workers (they never see the keys). Redis down at
    start: the workers weigh every tenant 1 until an API starts with Redis up."""
    try:
        tenants.publish_weights(r, key_ring_from_env())
    except redis.RedisError as error:
        log.warning("could not publish the tenants' weights: %s", error)


class BodyLimit:
    """Every request body stops at a size read per request: POST /v1/files at
    KVFLEET_MAX_UPLOAD_BYTES (an upload streams to storage), every other route at
    KVFLEET_MAX_REQUEST_BYTES. A declared Content-Length over it is refused before the body is
    read; a chunked body is cut off while it streams in, before any parser holds it (Starlette's
    body limit). The 413 is answered in OpenAI's shape (producers/errors.py)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        settings = Settings.from_env()
        if scope["method"] == "POST" and scope["path"] == "/v1/files":
            limit, too_large = settings.max_upload_bytes + MULTIPART_OVERHEAD_BYTES, file_too_large(
                settings.max_upload_bytes)
        else:
            limit, too_large = settings.max_request_bytes, request_too_large(settings.max_request_bytes)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit:  # Starlette's own answer is plain text
            await error_response(too_large)(scope, receive, send)
            return
        await RequestBodyLimitMiddleware(self.app, limit)(scope, receive, send)


class KeyFirst:
    """Every /v1 route checks the caller's key before a byte of its body is read: FastAPI reads
    and parses a body before it runs a route's dependencies, so without this a caller with no
    key could make the API parse (or spool to disk) whatever it sends before its 401."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            token = bearer_token(Headers(scope=scope).get("authorization", ""))
            if key_ring_from_env().caller(token) is None:
                await error_response(unauthorized())(scope, receive, send)
                return
        await self.app(scope, receive, send)


class CountRequests:
    """Every request by route, status and tenant (kvfleet:api_requests_total; "none" before
    the key is checked). Plain ASGI, not
    BaseHTTPMiddleware: that one wraps `receive`, and a handler behind it would not see its
    client leave."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def send_and_see(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_see)
        finally:
            route = scope["route"].path if "route" in scope else route_template(scope)
            tenant = scope.get("state", {}).get("tenant", "none")  # a configured one: bounded
            scope["app"].state.services.http_requests.labels(route, str(status[0]), tenant).inc()


def route_template(scope: Scope) -> str:
    """The path template of a request answered before routing (a 401 or a 413 of the middleware),
    from the API's documented paths: a bounded label, whatever path a caller sends."""
    app = scope["app"]
    if not hasattr(app.state, "path_templates"):
        app.state.path_templates = [(compile_path(path)[0], path) for path in app.openapi()["paths"]]
    return next((path for regex, path in app.state.path_templates if regex.match(scope["path"])), "unmatched")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m producers.api", description="OpenAI-compatible Batches API")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--redis-url", default=keys.default_redis_url(), help=REDIS_URL_HELP)
    parser.add_argument("--forwarded-allow-ips", default=os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1"),
                        help="comma-separated addresses of the TLS proxies whose X-Forwarded-Proto/-For to "
                             "trust (the console's Secure cookie and Origin check behind HTTPS); '*' trusts any")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        key_ring_from_env()
        default_retention()
        check_startup(connect(args.redis_url))
    except (StartupError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    uvicorn.run(create_app(args.redis_url), host=args.host, port=args.port, log_level="info",
                proxy_headers=True, forwarded_allow_ips=args.forwarded_allow_ips)
    return 0


if __name__ == "__main__":
    sys.exit(main())
