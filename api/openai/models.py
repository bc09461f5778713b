"""The models the live workers serve: each worker refreshes its model's entry in Redis
with its heartbeat (worker.consumer), so a model whose workers are all gone drops out
within FANOUT_HEARTBEAT_TTL."""
from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request

from results import keys
from worker.embedder.params import dimensions_error

from .errors import OpenAIError, not_found
from .schemas import ChatMessage, Model, ModelList, image_error

router = APIRouter()


def served(redis) -> dict[str, dict]:
    """name -> its model object (id, when it started being served, its context length)."""
    now, out = time.time(), {}
    for name, raw in redis.hgetall(keys.models()).items():
        entry = json.loads(raw)
        if entry["expires"] > now:
            out[name.decode()] = {"id": name.decode(), "root": name.decode(), "created": entry["created"],
                                  "max_model_len": entry.get("max_model_len")}
    return out


ROUTES = {"generate": "/v1/chat/completions, /v1/completions, /v1/responses or /v1/messages",
          "embed": "/v1/embeddings"}


def require(redis, name: str, task: str | None = "generate") -> None:
    """OpenAIError 404 unless a live worker serves `name`; 400 when it serves it for another
    task (an embedding model asked for text, or the other way round; None: any task)."""
    if name not in served(redis):
        raise OpenAIError(404, f"The model '{name}' does not exist or no worker serves it now (GET /v1/models "
                               "lists the served ones)", param="model", code="model_not_found")
    has = (_announced(redis, name) or {}).get("task", "generate")
    if task is not None and has != task:
        kind = "an embedding model" if has == "embed" else "a text generation model"
        raise OpenAIError(400, f"The model '{name}' is {kind}: use it with {ROUTES[has]}", param="model",
                          code="model_not_supported")


def _announced(redis, name: str) -> dict | None:
    """What `name`'s workers announce with their heartbeat (worker.consumer), None when no
    worker serves it."""
    raw = redis.hget(keys.models(), name)
    return None if raw is None else json.loads(raw)


def task(redis, name: str) -> str | None:
    """The task `name`'s workers run (jobs.spec.TASKS), None when no worker serves it."""
    entry = _announced(redis, name)
    return None if entry is None else entry.get("task", "generate")


def image_schemes(redis, name: str) -> list[str] | None:
    """The image URL schemes `name`'s workers take: [] for a text model, None when no worker
    serves it."""
    entry = _announced(redis, name)
    if entry is None:
        return None
    schemes = entry.get("images")
    return schemes if isinstance(schemes, list) else []


def require_dimensions(redis, name: str, dimensions: int | None) -> None:
    """OpenAIError 400 unless `name`'s vectors come in `dimensions` (None: its own)."""
    entry = _announced(redis, name)
    if entry is not None and dimensions is not None:
        why = dimensions_error(dimensions, entry.get("dimensions") or 0, entry.get("matryoshka"))
        if why is not None:
            raise OpenAIError(400, f"dimensions: {why}", param="dimensions", code="unsupported_value")


def require_tool_format(redis, name: str) -> None:
    """OpenAIError 400 unless `name` has a chat template, whose tool format (its own, or the
    generic one: worker/engine/tools.py) tool_choice auto parses."""
    entry = _announced(redis, name)
    if entry is not None and not entry.get("tools"):
        raise OpenAIError(400, f"tool_choice: auto needs a chat template, and the model '{name}' has none",
                          param="tool_choice", code="unsupported_parameter")


def require_images(redis, name: str, messages: list[ChatMessage]) -> None:
    """OpenAIError 400 naming the first image part `name`'s workers cannot take."""
    schemes = image_schemes(redis, name)
    if schemes is not None and (bad := image_error(messages, name, schemes)):  # not served: require's 404
        raise OpenAIError(400, bad[1], param=bad[0], code="unsupported_parameter")


@router.get("/models", response_model=ModelList)
def list_models(request: Request):
    """The models that live workers serve."""
    return {"data": [m for _, m in sorted(served(request.app.state.redis).items())]}


@router.get("/models/{model:path}", response_model=Model)
def get_model(model: str, request: Request):
    found = served(request.app.state.redis).get(model)
    if found is None:
        raise not_found("model", model, code="model_not_found")
    return found
