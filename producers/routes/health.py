"""GET /healthz (Redis answers), GET /metrics (Prometheus) and GET /queue/{model} (the batch
backlog KEDA scales workers on), outside /v1. /healthz is open and says only a status; with
keys set, /metrics (tenant names) and /queue (every model's and adapter's backlog) need
KVFLEET_METRICS_KEY, the key Prometheus and KEDA send, or the admin's."""

from __future__ import annotations

import logging

import redis
from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jobs import backlog, keys
from producers.dependencies import MonitorDep, RedisDep, ServicesDep

log = logging.getLogger("kvfleet.api")
router = APIRouter(tags=["health"])


@router.get("/healthz", responses={503: {"description": "Redis does not answer"}})
def healthz(r: RedisDep):
    """A probe's answer: a status, never what broke (that goes to the log)."""
    try:
        r.ping()
    except redis.RedisError as error:
        log.warning("healthz: redis does not answer: %s", error)
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return {"status": "ok"}


MONITOR_ERRORS = {401: {"description": "Keys are set and this is neither KVFLEET_METRICS_KEY nor the admin key"}}


@router.get("/metrics", response_class=PlainTextResponse, dependencies=[MonitorDep], responses=MONITOR_ERRORS)
def metrics(services: ServicesDep):
    return Response(generate_latest(services.metrics_registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/queue/{model}", dependencies=[MonitorDep], responses=MONITOR_ERRORS)
def queue_backlog(model: str, r: RedisDep):
    """The model's batch backlog over every batch's queue (jobs/queues.py): `lag`, requests no
    worker was given yet, is what KEDA's metrics-api trigger scales on; `pending`, requests
    being run."""
    pending, lag = backlog.totals(r, [model])  # the summary: O(partitions), whatever the open batches
    return {"model": model, "lag": lag, "pending": pending, "queues": r.zcard(keys.queues(model))}
