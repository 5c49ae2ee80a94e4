"""GET /v1/models and /v1/models/{model}: what live workers serve."""

from __future__ import annotations

from typing import Any

from jobs import heartbeats
from producers.dependencies import RedisDep
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


@router.get("/models")
def list_models(r: RedisDep):
    served = heartbeats.served_models(r)
    return {"object": "list", "data": [model_object(name, served[name]) for name in sorted(served)]}


@router.get("/models/{model:path}")
def retrieve_model(model: str, r: RedisDep):
    served = heartbeats.served_models(r)
    if model not in served:
        raise model_not_found(model)
    return model_object(model, served[model])
