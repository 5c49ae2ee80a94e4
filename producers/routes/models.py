"""GET /v1/models and /v1/models/{model}: what live workers serve, less the LoRA adapters other
tenants named by path (jobs/adapters.py: they do not exist for the caller)."""

from __future__ import annotations

from typing import Any

from jobs import adapters, heartbeats
from jobs.tenants import Caller
from producers.dependencies import CallerDep, RedisDep
from producers.errors import APIError
from producers.routes import v1_router

router = v1_router("models")


def model_object(name: str, served: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's model object, with vLLM's max_model_len and root, and what the model does
    (`task`: generate, or embed for /v1/embeddings)."""
    return {"id": name, "object": "model", "created": served["created"], "owned_by": "kvfleet",
            "root": served["root"], "parent": served.get("parent"), "max_model_len": served["max_model_len"],
            "task": served["task"]}


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist: no live worker serves it.", "model_not_found", "model")


def resolve_adapter(r, model: str, tenant: str, is_admin: bool) -> str | None:
    """jobs.adapters.resolve, its quota as the API's 429."""
    try:
        return adapters.resolve(r, model, tenant, is_admin)
    except adapters.AdapterQuotaExceeded as error:
        raise APIError(429, f"{error}.", "quota_exceeded", "model", kind="rate_limit_error") from None


def visible_models(r, caller: Caller) -> dict[str, Any]:
    """What live workers serve, as the caller may see it."""
    served = heartbeats.served_models(r)
    for name in adapters.hidden_from(r, caller.tenant.name, caller.is_admin):
        served.pop(name, None)
    return served


@router.get("/models")
def list_models(r: RedisDep, caller: CallerDep):
    served = visible_models(r, caller)
    return {"object": "list", "data": [model_object(name, served[name]) for name in sorted(served)]}


@router.get("/models/{model:path}")
def retrieve_model(model: str, r: RedisDep, caller: CallerDep):
    served = visible_models(r, caller)
    if model not in served:
        raise model_not_found(model)
    return model_object(model, served[model])
