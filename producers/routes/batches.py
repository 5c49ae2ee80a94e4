"""The Batches API: POST /v1/batches, GET /v1/batches, GET /v1/batches/{id},
POST /v1/batches/{id}/cancel, and beyond OpenAI GET /v1/batches/{id}/results/{custom_id}.

A caller sees its tenant's batches only (jobs/tenants.py); another tenant's are 404, and a
batch may read only its own tenant's input file. A tenant's max_open_batches and
max_queued_lines are checked when a batch is created (429, OpenAI's rate-limit error shape),
from counts kept where they change (jobs/tenant_backlog.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Query
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from jobs import adapters, batches, heartbeats, outlook, retention, tenant_backlog
from jobs.files import FileNotFound, owned_file, read_lines
from jobs.schemas import ENDPOINTS
from jobs.storage import allowed_outputs, check_output_allowed, default_output, find_result
from jobs.tenants import Caller, Tenant
from producers.dependencies import CallerDep, RedisDep
from producers.errors import APIError
from producers.idempotency import create_once
from producers.ingest import Submission, submit
from producers.routes import v1_router
from producers.routes.files import IdempotencyKey, file_not_found
from producers.routes.models import model_not_found, resolve_adapter

router = v1_router("batches")


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    output: str = Field(default_factory=default_output,
                        description="kvfleet extension: where results go (redis, s3://..., file:///...)")
    model: str | None = Field(None, description="kvfleet extension: the served model (stream)")
    output_expires_after: dict[str, Any] | None = Field(None, description="OpenAI's: {anchor: created_at, seconds}, "
                                                                          "the output and error files' expiry")


def load_batch_fields(r, batch_id: str, caller: Caller) -> dict[str, Any]:
    """The batch's fields if the caller's tenant owns it; 404 as if absent otherwise."""
    try:
        return batches.owned_fields(r, batch_id, caller)
    except batches.BatchNotFound:
        raise APIError(404, f"No batch found with id '{batch_id}'.", "batch_not_found") from None


def load_batch(r, batch_id: str) -> dict[str, Any]:
    return batches.batch_object(r, batch_id)


@router.post("/batches")
def create_batch(body: CreateBatch, r: RedisDep, caller: CallerDep, idempotency_key: IdempotencyKey = None):
    return create_once(r, "/v1/batches", idempotency_key, lambda: submit_batch(r, body, caller),
                       lambda batch_id: load_batch(r, batch_id), caller.tenant.name)


def submit_batch(r, body: CreateBatch, caller: Caller) -> dict[str, Any]:
    try:
        owned_file(r, body.input_file_id, caller)
    except FileNotFound:
        raise file_not_found(body.input_file_id, "input_file_id") from None
    if body.endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint: must be one of {', '.join(ENDPOINTS)}", "invalid_endpoint", "endpoint")
    try:
        batches.parse_window(body.completion_window)
        check_output_allowed(body.output, allowed_outputs())
        output_expires_after = retention.parse_expires_after(body.output_expires_after, "output_expires_after")
    except ValueError as error:
        raise APIError(400, str(error), "invalid_request", str(error).split(":")[0]) from None
    submission = submit(r, lambda: read_lines(r, body.input_file_id), endpoint=body.endpoint, model=body.model,
                        sink=body.output, completion_window=body.completion_window, metadata=body.metadata,
                        input_file_id=body.input_file_id, tenant=caller.tenant.name,
                        output_expires_after=output_expires_after,
                        before_enqueue=lambda report: check_before_enqueue(r, caller, report.model, report.num_lines))
    if not submission.accepted:  # OpenAI's behaviour: the batch exists, failed, with the line errors
        return failed_batch(r, submission, body, caller)
    batch = load_batch(r, submission.batch_id)
    if batch["model"] not in heartbeats.served_models(r) and \
            resolve_adapter(r, batch["model"], caller.tenant.name, caller.is_admin) is None:
        # kvfleet extension: it would wait silently
        batch["warnings"] = [f"No live worker serves model {batch['model']!r}: the batch waits for one, and "
                             f"expires at the end of its completion window."]
    return batch


def check_before_enqueue(r, caller: Caller, model: str, num_lines: int) -> None:
    """Another tenant's adapter is no model for this caller (404, nothing created); then the quotas."""
    if not adapters.check_access(r, model, caller.tenant.name, caller.is_admin):
        raise model_not_found(model)
    check_open_batches(r, caller.tenant)
    check_queued_lines(r, caller.tenant, num_lines)


def check_open_batches(r, tenant: Tenant) -> None:
    """429 if the tenant has max_open_batches batches not yet ended (jobs/tenant_backlog.py)."""
    if tenant.max_open_batches is None:
        return
    num_open = tenant_backlog.open_batches(r, tenant.name)
    if num_open >= tenant.max_open_batches:
        raise APIError(429, f"Tenant {tenant.name!r} has {num_open} batches open: its max_open_batches of "
                            f"{tenant.max_open_batches}. Wait for some to end, or put more lines in one batch.",
                       "quota_exceeded", "max_open_batches", kind="rate_limit_error")


def check_queued_lines(r, tenant: Tenant, num_lines: int) -> None:
    """429 if the tenant's unfinished batch lines would pass its max_queued_lines. (Two
    submissions at the same moment may both pass: the quota bounds a backlog, not a race.)"""
    if tenant.max_queued_lines is None:
        return
    queued = tenant_backlog.queued_lines(r, tenant.name)
    if queued + num_lines > tenant.max_queued_lines:
        raise APIError(429, f"Tenant {tenant.name!r} has {queued} batch lines queued; {num_lines} more would pass "
                            f"its max_queued_lines of {tenant.max_queued_lines}.", "quota_exceeded",
                       "max_queued_lines", kind="rate_limit_error")


def failed_batch(r, submission: Submission, body: CreateBatch, caller: Caller) -> dict[str, Any]:
    report, batch_id = submission.report, submission.batch_id
    batches.create_batch(r, batch_id, endpoint=body.endpoint, model=report.model or "default",
                         input_file_id=body.input_file_id, completion_window=body.completion_window,
                         sink=body.output, metadata=body.metadata, tenant=caller.tenant.name)
    errors = [{"code": "invalid_request", "message": e.message, "line": e.line_number or None,
               "param": e.field} for e in report.errors]
    batches.fail_with_errors(r, batch_id, errors, total=report.num_lines)
    return load_batch(r, batch_id)


@router.get("/batches")
def list_batches(r: RedisDep, caller: CallerDep, after: str | None = None,
                 limit: Annotated[int, Query(ge=1, le=100)] = 20):
    try:
        ids = batches.list_batch_ids(r, after, limit + 1, tenant=caller.listed_tenant)
    except batches.BatchNotFound:
        raise APIError(404, f"No batch found with id '{after}'.", "batch_not_found", "after") from None
    view = outlook.FleetView(r, batches.load_many)  # the fleet's numbers, read once for the page
    data = [batches.openai_object(r, fields, view) for fields in batches.load_many(r, ids[:limit]) if fields is not None]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ids) > limit}


@router.get("/batches/{batch_id}")
def retrieve_batch(batch_id: str, r: RedisDep, caller: CallerDep):
    return batches.openai_object(r, load_batch_fields(r, batch_id, caller))


@router.post("/batches/{batch_id}/cancel")
def cancel_batch(batch_id: str, r: RedisDep, caller: CallerDep):
    load_batch_fields(r, batch_id, caller)
    try:
        batches.transition(r, batch_id, "cancelling")
    except batches.IllegalTransition as error:
        raise APIError(409, str(error), "batch_not_cancellable") from None
    return load_batch(r, batch_id)


@router.get("/batches/{batch_id}/results/{custom_id}")
def retrieve_result(batch_id: str, custom_id: str, r: RedisDep, caller: CallerDep):
    line = find_result(load_batch_fields(r, batch_id, caller)["sink"], r, batch_id, custom_id)
    if line is None:
        raise APIError(404, f"No result yet for custom_id '{custom_id}' in batch '{batch_id}'.",
                       "result_not_found")
    return Response(line, media_type="application/json")
