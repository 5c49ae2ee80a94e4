"""Errors of the HTTP API, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Every error the API answers goes through here: kvfleet's own `APIError`, Starlette's 404
and 405, and request validation (400, where FastAPI would answer 422). The OpenAPI
document says the same (`openai_style_schema`).
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from jobs.schemas import field_path


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind


def error_body(message: str, kind: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    response = JSONResponse(error_body(error.message, error.kind, error.code, error.param), status_code=error.status)
    if error.status in (429, 503):
        response.headers["Retry-After"] = "1"
    return response


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
                                (429, "Online queue full (Retry-After)"),
                                (503, "No worker of a scaled-to-zero model started in time (Retry-After)"),
                                (504, "KVFLEET_REQUEST_TIMEOUT passed"))}


async def api_error(_: Request, error: APIError) -> JSONResponse:
    return error_response(error)


async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Starlette's own 404 and 405 in OpenAI's shape; a 405 names every method the path has."""
    headers = dict(error.headers or {})
    if error.status_code == 405:
        headers["Allow"] = ", ".join(sorted({method for route in request.app.routes if isinstance(route, APIRoute)
                                             and route.path_regex.match(request.url.path)
                                             for method in route.methods}))
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(error.status_code,
                                                                                      "http_error")
    message, param = str(error.detail), None
    if error.status_code == 413 and request.url.path == "/v1/files":  # Starlette's body limit (producers/api.py)
        message, param, code = "The upload is larger than KVFLEET_MAX_UPLOAD_BYTES allows.", "file", "file_too_large"
    elif error.status_code == 413:
        message = "The request body is larger than KVFLEET_MAX_REQUEST_BYTES allows."
    return JSONResponse(error_body(message, "invalid_request_error", code, param), status_code=error.status_code,
                        headers=headers)


FORM_FIELD = re.compile(r"^(\w+)\[(\w+)\]$")


async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    """The first invalid field, named by its path in the body: a 400, as OpenAI answers."""
    detail = error.errors()[0]
    # A form's nested field (OpenAI's `expires_after[seconds]`) is named as in JSON.
    loc = tuple(FORM_FIELD.sub(r"\1.\2", p) if isinstance(p, str) else p for p in detail["loc"])
    param = ".".join(field_path(tuple(p for p in loc if p not in ("body", "query", "path"))))
    reason = detail["msg"].removeprefix("Value error, ")
    message = f"{param}: {reason}" if param else reason
    return JSONResponse(error_body(message, "invalid_request_error", "invalid_request", param or None),
                        status_code=400)


async def too_deep(_: Request, __: RecursionError) -> JSONResponse:
    """A value nested beyond what a validator can walk (the JSON parser's own failure is a 400
    already): the client's input, never a 500."""
    return JSONResponse(error_body("The request body nests too deeply.", "invalid_request_error", "invalid_request"),
                        status_code=400)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RecursionError, too_deep)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)


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
