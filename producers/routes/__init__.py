"""The API's routers, one module each; producers/api.py assembles them."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from producers.dependencies import require_caller
from producers.errors import ERROR_RESPONSES


def v1_router(tag: str) -> APIRouter:
    """A router under /v1: behind the API keys, its errors documented in OpenAI's shape."""
    return APIRouter(prefix="/v1", tags=[tag], dependencies=[Depends(require_caller)], responses=ERROR_RESPONSES)
