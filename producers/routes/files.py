"""The Files API: POST /v1/files (purpose batch), GET /v1/files (purpose, limit, after, order),
GET /v1/files/{id} and its /content, DELETE /v1/files/{id}. A caller sees its tenant's files
only (jobs/tenants.py): another tenant's are 404, as if absent. `expires_after` (OpenAI's
form fields) or KVFLEET_DEFAULT_RETENTION sets a file's `expires_at` (jobs/retention.py).

Uploads stream to storage in 1 MiB chunks and stop at KVFLEET_MAX_UPLOAD_BYTES (413);
producers/api.py refuses a Content-Length over it before the body is read.
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import File, Form, Header, Query, UploadFile
from fastapi.responses import StreamingResponse

from jobs import files, keys, retention
from jobs.files import FileNotFound, create_file, file_object, new_file_id, owned_file, read_file
from jobs.storage import RedisStorage
from jobs.tenants import Caller
from producers.dependencies import CallerDep, RedisDep, Settings, SettingsDep
from producers.errors import APIError
from producers.idempotency import create_once
from producers.routes import v1_router

router = v1_router("files")
IdempotencyKey = Annotated[str | None, Header(max_length=255, description="kvfleet extension, as Stripe's: a "
                           "retry with the same key within 24 h returns the first try's object")]


def file_too_large(limit: int) -> APIError:
    return APIError(413, f"file is larger than {limit} bytes (KVFLEET_MAX_UPLOAD_BYTES)", "file_too_large", "file")


def file_not_found(file_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No file found with id '{file_id}'.", "file_not_found", param)


@router.post("/files")
def upload_file(file: Annotated[UploadFile, File()], purpose: Annotated[Literal["batch"], Form()], r: RedisDep,
                settings: SettingsDep, caller: CallerDep, idempotency_key: IdempotencyKey = None,
                anchor: Annotated[Literal["created_at"], Form(alias="expires_after[anchor]")] = None,  # type: ignore[assignment]
                seconds: Annotated[int, Form(alias="expires_after[seconds]", ge=retention.MIN_SECONDS,
                                             le=retention.MAX_SECONDS)] = None):  # type: ignore[assignment]
    # OpenAI's expires_after, as its client sends it in a form (optional, yet typed without
    # null: a form field has no null). `created_at` is the only anchor, so seconds alone mean
    # it, and an anchor alone sets nothing.
    expires_after = seconds
    return create_once(r, "/v1/files", idempotency_key,
                       lambda: store_upload(r, file, purpose, settings, caller, expires_after),
                       lambda file_id: file_object(r, file_id), caller.tenant.name)


def store_upload(r, file: UploadFile, purpose: str, settings: Settings, caller: Caller,
                 expires_after: int | None) -> dict:
    limit = settings.max_upload_bytes

    def chunks():
        size = 0
        while chunk := file.file.read(1 << 20):
            size += len(chunk)
            if size > limit:
                raise file_too_large(limit)
            yield chunk

    file_id = new_file_id()
    try:
        return create_file(r, RedisStorage(r), chunks(), file.filename or "upload.jsonl", purpose, file_id,
                           tenant=caller.tenant.name, expires_after=expires_after)
    except APIError:
        r.delete(keys.file_content(file_id))  # drop the partial content of a rejected upload
        raise


@router.get("/files")
def list_files(r: RedisDep, caller: CallerDep, purpose: str | None = None, after: str | None = None,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
               order: Annotated[Literal["asc", "desc"], Query()] = "desc"):
    try:
        data, has_more = files.list_files(r, purpose, after, limit, order,
                                          tenant=caller.listed_tenant)
    except FileNotFound:
        raise file_not_found(after, "after") from None
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


@router.delete("/files/{file_id}")
def delete_file(file_id: str, r: RedisDep, caller: CallerDep):
    try:
        owned_file(r, file_id, caller)
        return files.delete_file(r, file_id)
    except FileNotFound:
        raise file_not_found(file_id) from None


@router.get("/files/{file_id}")
def retrieve_file(file_id: str, r: RedisDep, caller: CallerDep):
    try:
        return owned_file(r, file_id, caller)
    except FileNotFound:
        raise file_not_found(file_id) from None


@router.get("/files/{file_id}/content", response_class=StreamingResponse,
            responses={200: {"content": {"application/jsonl": {}}, "description": "The file's bytes"}})
def retrieve_file_content(file_id: str, r: RedisDep, caller: CallerDep):
    try:
        info, chunks = owned_file(r, file_id, caller), read_file(r, file_id)
    except FileNotFound:
        raise file_not_found(file_id) from None
    return StreamingResponse(chunks, media_type="application/jsonl",
                             headers={"Content-Disposition": content_disposition(info["filename"])})


def content_disposition(filename: str) -> str:
    """An attachment header for any file name: an ASCII fallback, and RFC 5987's UTF-8 form."""
    fallback = "".join(c if c.isascii() and c.isprintable() and c not in '"\\' else "_" for c in filename)
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"
