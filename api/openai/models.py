"""The models of the fleet as the OpenAI surface shows them (GET /v1/models: the live ones)
and the checks of a request's model against what its workers announced (jobs/models.py).
A known model with no live worker takes requests, which wait for one; an unknown one is a 404."""
from __future__ import annotations

from fastapi import APIRouter, Request

from jobs import models as fleet
from worker.embedder.params import dimensions_error

from .errors import OpenAIError, not_found
from .schemas import ChatMessage, Model, ModelList, image_error

router = APIRouter()


def served(redis) -> dict[str, dict]:
    """name -> its model object, for the models a live worker serves."""
    return {name: _card(m) for name, m in fleet.live(redis).items()}


def _card(m: fleet.Model) -> dict:
    return {"id": m.name, "root": m.name, "parent": m.parent, "created": m.entry.get("created", 0),
            "max_model_len": m.entry.get("max_model_len")}


def require(redis, name: str, task: str | None = "generate") -> fleet.Model:
    """The known model `name`; OpenAIError 404 when the fleet does not know it, 400 when it is
    another task's (an embedding model asked for text, or the other way round; None: any)."""
    try:
        return fleet.resolve(redis, name, task)
    except fleet.ModelError as e:
        raise OpenAIError(e.status, e.message, param="model", code=e.code) from None


def _announced(redis, name: str) -> dict | None:
    """What `name`'s live workers announce with their heartbeat, None when none is live
    (the checks that need it are then the worker's, item by item)."""
    m = fleet.get(redis, name)
    return m.entry if m is not None and m.live else None


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
