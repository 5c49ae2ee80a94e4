"""The Files API: POST /v1/files (purpose batch), GET /v1/files/{id} and its /content.

Uploads stream to storage in 1 MiB chunks and stop at KVFLEET_MAX_UPLOAD_BYTES (413);
producers/api.py refuses a Content-Length over it before the body is read.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import File, Form, Header, UploadFile
from fastapi.responses import StreamingResponse

from jobs import keys
from jobs.files import FileNotFound, create_file, file_object, new_file_id, read_file
from jobs.storage import RedisStorage
from producers.dependencies import RedisDep, Settings, SettingsDep
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
                settings: SettingsDep, idempotency_key: IdempotencyKey = None):
    return create_once(r, "/v1/files", idempotency_key, lambda: store_upload(r, file, purpose, settings),
                       lambda file_id: file_object(r, file_id))


def store_upload(r, file: UploadFile, purpose: str, settings: Settings) -> dict:
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
        return create_file(r, RedisStorage(r), chunks(), file.filename or "upload.jsonl", purpose, file_id)
    except APIError:
        r.delete(keys.file_content(file_id))  # drop the partial content of a rejected upload
        raise


@router.get("/files/{file_id}")
def retrieve_file(file_id: str, r: RedisDep):
    try:
        return file_object(r, file_id)
    except FileNotFound:
        raise file_not_found(file_id) from None


@router.get("/files/{file_id}/content", response_class=StreamingResponse,
            responses={200: {"content": {"application/jsonl": {}}, "description": "The file's bytes"}})
def retrieve_file_content(file_id: str, r: RedisDep):
    try:
        chunks = read_file(r, file_id)
    except FileNotFound:
        raise file_not_found(file_id) from None
    return StreamingResponse(chunks, media_type="application/jsonl")
