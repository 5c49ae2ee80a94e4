"""GET /healthz (Redis answers) and GET /metrics (Prometheus), outside /v1 and its key."""

from __future__ import annotations

import redis
from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from producers.dependencies import RedisDep, ServicesDep

router = APIRouter(tags=["health"])


@router.get("/healthz", responses={503: {"description": "Redis does not answer"}})
def healthz(r: RedisDep):
    try:
        r.ping()
    except redis.RedisError as error:
        return JSONResponse({"status": "unavailable", "redis": str(error)}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(services: ServicesDep):
    return Response(generate_latest(services.metrics_registry), media_type=CONTENT_TYPE_LATEST)
