"""OpenAI-compatible API (FastAPI + uvicorn): online completions, Files and Batches.

    python -m producers.api [--host 127.0.0.1] [--port 8000] [--redis-url URL]

Routes: POST /v1/completions and /v1/chat/completions (online, through the queue;
producers/online.py), GET /v1/models (what live workers serve), GET /v1/models/{model},
POST /v1/files, GET /v1/files/{id}, GET /v1/files/{id}/content,
POST /v1/batches, GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel,
and beyond OpenAI GET /v1/batches/{id}/results/{custom_id}; GET /healthz,
GET /metrics, and the operator console under /ui (producers/console.py). With KVFLEET_API_KEY set, every /v1 route needs
`Authorization: Bearer <key>` (compared in constant time). Errors use OpenAI's
{"error": {...}} shape. Uploads stream to storage in 1 MiB chunks and stop at
KVFLEET_MAX_UPLOAD_BYTES (413; a Content-Length over it is refused before the body
is read). CORS is off unless KVFLEET_CORS_ORIGINS lists the allowed origins.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from typing import Annotated, Any, Literal

import redis
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, File, Form, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from jobs import batches, heartbeats, keys
from jobs.connection import REDIS_URL_HELP, connect, connect_async
from jobs.files import FileNotFound, create_file, file_object, new_file_id, read_file, read_lines
from jobs.schemas import field_path
from jobs.storage import RedisStorage, find_result, open_storage
from producers.console import add_console_routes
from producers.errors import APIError, error_body, error_response
from producers.ingest import submit
from producers.online import OnlineStats, add_online_routes

DEFAULT_MAX_UPLOAD_BYTES = 200 * 1024 * 1024
MULTIPART_OVERHEAD_BYTES = 64 * 1024  # room for the form's other fields and boundaries


def max_upload_bytes() -> int:
    return int(os.environ.get("KVFLEET_MAX_UPLOAD_BYTES", DEFAULT_MAX_UPLOAD_BYTES))


def file_too_large(limit: int) -> APIError:
    return APIError(413, f"file is larger than {limit} bytes (KVFLEET_MAX_UPLOAD_BYTES)", "file_too_large", "file")


BEARER = HTTPBearer(auto_error=False, description="KVFLEET_API_KEY, when the server sets one")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, the body of every 4xx and 5xx."""

    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in ((400, "Invalid request"), (401, "Missing or wrong API key"), (404, "Not found"),
                                (409, "Conflicting state"), (413, "Upload too large"),
                                (429, "Online queue full (Retry-After)"), (504, "KVFLEET_REQUEST_TIMEOUT passed"))}


def openai_style_schema(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document, saying what the API really answers: validation errors are
    400 in OpenAI's shape (FastAPI would document 422)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                if operation.get("responses", {}).pop("422", None) is not None:
                    operation["responses"].setdefault("400", {
                        "description": "Invalid request",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})
        schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
        schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
        app.openapi_schema = schema
    return app.openapi_schema


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    output: str = Field(default_factory=lambda: os.environ.get("KVFLEET_DEFAULT_OUTPUT", "redis"),
                        description="kvfleet extension: where results go (redis, s3://..., file:///...)")
    model: str | None = Field(None, description="kvfleet extension: the served model (stream)")


def create_app(redis_url: str | None = None) -> FastAPI:
    r = connect(redis_url)
    registry = CollectorRegistry()
    http_requests = Counter("kvfleet:api_requests", "API requests by route and status", ["route", "status"],
                            registry=registry)
    app = FastAPI(title="kvfleet", description="OpenAI-compatible online completions, Files and Batches API")
    app.state.metrics_registry = registry
    cors_origins = [o.strip() for o in os.environ.get("KVFLEET_CORS_ORIGINS", "").split(",") if o.strip()]
    if cors_origins:  # off by default: browsers on other origins may not call the API
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    def require_key(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)] = None) -> None:
        expected = os.environ.get("KVFLEET_API_KEY")
        if not expected:
            return
        token = credentials.credentials if credentials is not None else ""
        if not secrets.compare_digest(token.encode(), expected.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                           "invalid_api_key", kind="authentication_error")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)], responses=ERROR_RESPONSES)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError):
        response = error_response(error)
        if error.status == 429:
            response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException):
        """Starlette's own 404 and 405 in OpenAI's shape; a 405 names every method the path has."""
        headers = dict(error.headers or {})
        if error.status_code == 405:
            headers["Allow"] = ", ".join(sorted({method for route in app.routes if isinstance(route, APIRoute)
                                                 and route.path_regex.match(request.url.path)
                                                 for method in route.methods}))
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        return JSONResponse(error_body(str(error.detail), "invalid_request_error", code), status_code=error.status_code,
                            headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError):
        detail = error.errors()[0]
        param = ".".join(field_path(tuple(p for p in detail["loc"] if p not in ("body", "query", "path"))))
        reason = detail["msg"].removeprefix("Value error, ")
        message = f"{param}: {reason}" if param else reason
        return JSONResponse(error_body(message, "invalid_request_error", "invalid_request", param or None),
                            status_code=400)

    @app.middleware("http")
    async def _count(request: Request, call_next):
        limit = max_upload_bytes()
        declared = request.headers.get("content-length", "")
        if request.url.path == "/v1/files" and declared.isdigit() and int(declared) > limit + MULTIPART_OVERHEAD_BYTES:
            http_requests.labels("/v1/files", "413").inc()
            return error_response(file_too_large(limit))  # refused before the body is read
        response = await call_next(request)
        route = request.scope.get("route")
        http_requests.labels(getattr(route, "path", "unmatched"), str(response.status_code)).inc()
        return response

    def model_object(name: str, served: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's model object, with vLLM's max_model_len and root."""
        return {"id": name, "object": "model", "created": served["created"], "owned_by": "kvfleet",
                "root": served["root"], "parent": None, "max_model_len": served["max_model_len"]}

    @v1.get("/models")
    def list_models():
        served = heartbeats.served_models(r)
        return {"object": "list", "data": [model_object(name, served[name]) for name in sorted(served)]}

    @v1.get("/models/{model:path}")
    def retrieve_model(model: str):
        served = heartbeats.served_models(r)
        if model not in served:
            raise APIError(404, f"The model '{model}' does not exist: no live worker serves it.", "model_not_found",
                           "model")
        return model_object(model, served[model])

    def get_fields(batch_id: str) -> dict[str, Any]:
        try:
            return batches.load_fields(r, batch_id)
        except batches.BatchNotFound:
            raise APIError(404, f"No batch found with id '{batch_id}'.", "batch_not_found") from None

    def get_batch(batch_id: str) -> dict[str, Any]:
        return batches.as_openai(get_fields(batch_id))

    @v1.post("/files")
    def upload_file(file: Annotated[UploadFile, File()], purpose: Annotated[Literal["batch"], Form()]):

        limit = max_upload_bytes()

        def chunks():
            size = 0
            while chunk := file.file.read(1 << 20):
                size += len(chunk)
                if size > limit:
                    raise file_too_large(limit)
                yield chunk

        file_id = new_file_id()
        try:
            return create_file(r, RedisStorage(r), chunks(), file.filename or "upload.jsonl", purpose, file_id)
        except APIError:
            r.delete(keys.file_content(file_id))  # drop the partial content of a rejected upload
            raise

    @v1.get("/files/{file_id}")
    def get_file(file_id: str):
        try:
            return file_object(r, file_id)
        except FileNotFound:
            raise APIError(404, f"No file found with id '{file_id}'.", "file_not_found") from None

    @v1.get("/files/{file_id}/content", response_class=StreamingResponse,
            responses={200: {"content": {"application/jsonl": {}}, "description": "The file's bytes"}})
    def get_file_content(file_id: str):
        try:
            chunks = read_file(r, file_id)
        except FileNotFound:
            raise APIError(404, f"No file found with id '{file_id}'.", "file_not_found") from None
        return StreamingResponse(chunks, media_type="application/jsonl")

    @v1.post("/batches")
    def create_batch(body: CreateBatch):
        try:
            file_object(r, body.input_file_id)
        except FileNotFound:
            raise APIError(404, f"No file found with id '{body.input_file_id}'.", "file_not_found",
                           "input_file_id") from None
        if body.endpoint not in ("/v1/completions", "/v1/chat/completions"):
            raise APIError(400, "endpoint: must be /v1/completions or /v1/chat/completions", "invalid_endpoint",
                           "endpoint")
        try:
            batches.parse_window(body.completion_window)
            open_storage(body.output, r)
        except ValueError as error:
            raise APIError(400, str(error), "invalid_request", str(error).split(":")[0]) from None

        submission = submit(r, lambda: read_lines(r, body.input_file_id), endpoint=body.endpoint, model=body.model, sink=body.output,
                            completion_window=body.completion_window, metadata=body.metadata,
                            input_file_id=body.input_file_id)
        if not submission.accepted:  # OpenAI's behaviour: the batch exists, failed, with the line errors
            return failed_batch(submission, body)
        return get_batch(submission.batch_id)

    def failed_batch(submission, body: CreateBatch) -> dict[str, Any]:
        report, batch_id = submission.report, submission.batch_id
        batches.create_batch(r, batch_id, endpoint=body.endpoint, model=report.model or "default",
                             input_file_id=body.input_file_id, completion_window=body.completion_window,
                             sink=body.output, metadata=body.metadata)
        errors = [{"code": "invalid_request", "message": e.message, "line": e.line_number or None,
                   "param": e.field} for e in report.errors]
        r.hset(keys.batch(batch_id), mapping={"errors": json.dumps(errors), "total": report.num_lines})
        batches.transition(r, batch_id, "failed")
        return get_batch(batch_id)

    @v1.get("/batches")
    def list_batches(after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20):
        try:
            ids = batches.list_batch_ids(r, after, limit + 1)
        except batches.BatchNotFound:
            raise APIError(404, f"No batch found with id '{after}'.", "batch_not_found", "after") from None
        data = [batches.as_openai(fields) for fields in batches.load_many(r, ids[:limit]) if fields is not None]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(ids) > limit}

    @v1.get("/batches/{batch_id}")
    def retrieve_batch(batch_id: str):
        return get_batch(batch_id)

    @v1.post("/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str):
        get_batch(batch_id)
        try:
            batches.transition(r, batch_id, "cancelling")
        except batches.IllegalTransition as error:
            raise APIError(409, str(error), "batch_not_cancellable") from None
        return get_batch(batch_id)

    @v1.get("/batches/{batch_id}/results/{custom_id}")
    def get_result(batch_id: str, custom_id: str):
        line = find_result(get_fields(batch_id)["sink"], r, batch_id, custom_id)
        if line is None:
            raise APIError(404, f"No result yet for custom_id '{custom_id}' in batch '{batch_id}'.",
                           "result_not_found")
        return Response(line, media_type="application/json")

    @app.get("/healthz", responses={503: {"description": "Redis does not answer"}})
    def healthz():
        try:
            r.ping()
        except redis.RedisError as error:
            return JSONResponse({"status": "unavailable", "redis": str(error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    online_stats = OnlineStats()
    add_online_routes(v1, r, connect_async(redis_url), online_stats)
    app.include_router(v1)
    add_console_routes(app, r, online_stats)
    app.openapi = lambda: openai_style_schema(app)
    return app


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m producers.api", description="OpenAI-compatible Batches API")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--redis-url", default=keys.default_redis_url(), help=REDIS_URL_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    uvicorn.run(create_app(args.redis_url), host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    main()
