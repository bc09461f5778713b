"""/openapi.json as this server answers it: the bounds its settings set (FANOUT_MAX_*), not
only the engine's own, and request examples that run as shown (in Swagger's "Try it out"
too), naming a model the workers serve now. tests/service/test_docs.py POSTs every one."""
from __future__ import annotations

import copy
import json

from jobs import models as fleet
from jobs.settings import Settings


# Example bodies by (path, method); MODEL becomes the name of a served model of the path's
# task (TASKS; the others generate).
MODEL = "<model>"
TASKS = {"/v1/embeddings": "embed"}
EXAMPLES = {
    "/v1/jobs": {"prompts": ["Write a haiku about the sea.", "Name three rivers."],
                 "sampling_params": {"max_new_tokens": 32, "temperature": 0.7, "n": 2, "seed": 42}},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hello! Who are you?"}],
                             "max_tokens": 32, "temperature": 0},
    "/v1/completions": {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0},
    "/v1/responses": {"model": MODEL, "input": "Hello! Who are you?", "max_output_tokens": 32, "temperature": 0},
    "/tokenize": {"model": MODEL, "prompt": "Hello, world"},
    "/detokenize": {"model": MODEL, "tokens": [72, 101, 108]},
    "/v1/batches": {"input_file_id": "file-<id from POST /v1/files>", "endpoint": "/v1/chat/completions",
                    "completion_window": "24h"},
    "/v1/embeddings": {"model": MODEL, "input": ["The cat sits on the mat.", "Embeddings map text to vectors."]},
    "/v1/messages": {"model": MODEL, "max_tokens": 32, "messages": [{"role": "user", "content": "Hello! Who are you?"}]},
    "/v1/messages/batches": {"requests": [
        {"custom_id": f"q{i}", "params": {"model": MODEL, "max_tokens": 16,
                                          "messages": [{"role": "user", "content": q}]}}
        for i, q in enumerate(("Name three rivers.", "Write a haiku about the sea."))]},
}


def _bound(prop: dict, key: str, value: int) -> None:
    """Set `key` (maximum, maxItems) on a property's schema, or on each of its anyOf members
    that has one to set."""
    for s in prop.get("anyOf", [prop]):
        if s.get("type") in ("integer", "array"):
            s[key] = value


def limits(spec: dict, settings: Settings) -> None:
    """The configured limits, in the request schemas that the server checks them on."""
    tokens = ("max_new_tokens", "min_new_tokens", "max_tokens", "max_completion_tokens", "min_tokens",
              "max_output_tokens")
    for name in ("SamplingParams", "ChatCompletionRequest", "CompletionRequest", "MessagesRequest", "MessageBatchParams",
                 "ResponseRequest"):
        props = spec["components"]["schemas"][name]["properties"]
        for field in tokens:
            if field in props:
                _bound(props[field], "maximum", settings.max_new_tokens)
        if "n" in props:
            _bound(props["n"], "maximum", settings.max_n)
    jobs = spec["components"]["schemas"]["JobRequest"]["properties"]
    for kind in ("prompts", "input_ids", "messages"):
        _bound(jobs[kind], "maxItems", settings.max_batch)


def build(app, settings: Settings, redis) -> dict:
    """The schema with the limits and examples (the served model's name read now)."""
    if app.openapi_schema is None:
        base = app.__class__.openapi(app)  # FastAPI's own, cached on the app
        limits(base, settings)
    spec = copy.deepcopy(app.openapi_schema)
    try:
        served = {}  # task -> its first served model
        for name, m in sorted(fleet.live(redis).items()):
            served.setdefault(m.task, name)
    except Exception:  # Redis away: the examples name no model, the rest is as it is
        served = {}
    for path, body in EXAMPLES.items():
        op = spec["paths"][path]["post"]
        if (name := served.get(TASKS.get(path, "generate"))) is not None:  # wherever the body names a model
            body = json.loads(json.dumps(body).replace(json.dumps(MODEL), json.dumps(name)))
        op["requestBody"]["content"]["application/json"]["example"] = body
    return spec
