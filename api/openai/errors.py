"""OpenAI's error format, `{"error": {"message", "type", "param", "code"}}`, for the OpenAI
routes (api.app sends their validation, Redis and HTTP errors through here), so OpenAI
clients raise their usual exceptions (BadRequestError with `param`, NotFoundError, ...)."""
from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from jobs.spec import CONTENT_TAGS

PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/files", "/v1/batches",
         "/tokenize", "/detokenize", "/tokenizer_info")  # the last three: vLLM's routes, with its (OpenAI's) errors
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 409: "invalid_request_error", 429: "rate_limit_error"}


SKIP = frozenset({"body", "query", "path", "form"}) | CONTENT_TAGS  # not names of fields
# The labels pydantic gives a union's members in a location (`stop.constrained-str`,
# `stop.list[constrained-str].0`, `n.int`): types, never the name of a field.
TYPE_LABELS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _field(p) -> bool:
    return isinstance(p, int) or (p not in SKIP and p.isidentifier() and p not in TYPE_LABELS)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorResponse(BaseModel):
    error: ErrorBody


RESPONSES = {status: {"model": OpenAIErrorResponse, "description": what} for status, what in (
    (400, "invalid request (`param` names the field)"), (401, "missing or invalid API key"),
    (403, "not allowed for this API key"), (404, "unknown id or model"),
    (429, "over one of this API key's limits"), (503, "Redis is unavailable (try again)"))}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


NATIVE = ("/v1/jobs", "/v1/webhooks", "/v1/fleet")  # the native API's own routes under /v1 (and below them)


def is_openai(path: str) -> bool:
    """An OpenAI route's path, or a path under /v1 that is no route (a client of OpenAI's API
    that asks for what we lack reads OpenAI's error); the native API's own are not."""
    return path.startswith(PATHS) or (path.startswith("/v1/") and not any(
        path == p or path.startswith((p + "/", p + "?")) for p in NATIVE))


def not_found(what: str, id: str, code: str | None = None) -> OpenAIError:
    return OpenAIError(404, f"No such {what}: '{id}'", code=code)


def param(loc) -> str | None:
    """A pydantic location as OpenAI names a parameter: messages.0.content -> messages[0].content."""
    parts = [p for p in loc if _field(p)]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def from_validation(errors: list[dict]) -> OpenAIError:
    """The first of pydantic's errors, in OpenAI's words: an unknown field is an unsupported
    parameter; the message names the field."""
    # A union's members each report an error on the same field: the deepest says most
    # (`stop[0]: at least 1 character`, not `stop: should be a string`).
    first = param(errors[0].get("loc", ()))
    e = max((x for x in errors if param(x.get("loc", ())) is not None and first is not None
             and param(x.get("loc", ())).startswith(first)), key=lambda x: len(x.get("loc", ())), default=errors[0])
    name = param(e.get("loc", ()))
    if e.get("type") == "json_invalid":  # its location is a character offset, not a field
        at = next((p for p in e.get("loc", ()) if isinstance(p, int)), None)
        where = f" at character {at}" if at is not None else ""
        return OpenAIError(400, f"the body is not valid JSON ({e.get('msg', 'JSON decode error')}{where})",
                           code="invalid_json")
    if e.get("type") == "extra_forbidden":
        return OpenAIError(400, f"Unrecognized request argument supplied: {name} (not supported by this server)",
                           param=name, code="unsupported_parameter")
    where = f"{name}: " if name else ""
    return OpenAIError(400, f"{where}{e.get('msg', 'invalid value')}", param=name, code="invalid_value")
