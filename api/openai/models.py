"""The models the live workers serve: each worker refreshes its model's entry in Redis
with its heartbeat (worker.consumer), so a model whose workers are all gone drops out
within FANOUT_HEARTBEAT_TTL."""
from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request

from results import keys

from .errors import OpenAIError, not_found
from .schemas import Model, ModelList

router = APIRouter()


def served(redis) -> dict[str, int]:
    """name -> when it started being served (Unix seconds)."""
    now, out = time.time(), {}
    for name, raw in redis.hgetall(keys.models()).items():
        entry = json.loads(raw)
        if entry["expires"] > now:
            out[name.decode()] = entry["created"]
    return out


def require(redis, name: str) -> None:
    """OpenAIError 404 unless a live worker serves `name`."""
    if name not in served(redis):
        raise OpenAIError(404, f"The model '{name}' does not exist or no worker serves it now (GET /v1/models "
                               "lists the served ones)", param="model", code="model_not_found")


def takes_images(redis, name: str) -> bool:
    """Whether `name`'s workers take images in chats (None: no worker serves it; an entry
    from a worker that does not say: taken as not)."""
    raw = redis.hget(keys.models(), name)
    return None if raw is None else bool(json.loads(raw).get("images"))


def require_images(redis, name: str, part: str | None) -> None:
    """OpenAIError 400 naming the first image part when `name` does not take images."""
    if part is not None and takes_images(redis, name) is False:  # not served: require's 404
        raise OpenAIError(400, f"{part}: image_url parts are not supported by the model '{name}' "
                               "(it takes text only)", param=part, code="unsupported_parameter")


@router.get("/models", response_model=ModelList)
def list_models(request: Request):
    """The models that live workers serve."""
    return {"data": [{"id": name, "created": t} for name, t in sorted(served(request.app.state.redis).items())]}


@router.get("/models/{model:path}", response_model=Model)
def get_model(model: str, request: Request):
    created = served(request.app.state.redis).get(model)
    if created is None:
        raise not_found("model", model, code="model_not_found")
    return {"id": model, "created": created}
