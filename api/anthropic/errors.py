"""Errors in Anthropic's shape: {"type": "error", "error": {"type", "message"}}, for every
answer under /v1/messages (validation, auth, limits, outages, and the OpenAIError that a
shared helper such as models.require raises)."""
from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import BaseModel

PATH = "/v1/messages"
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
         503: "overloaded_error"}


class AnthropicErrorBody(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: str = "error"
    error: AnthropicErrorBody


RESPONSES = {status: {"model": AnthropicErrorResponse, "description": what} for status, what in (
    (400, "invalid request (the message names the field)"), (401, "missing or invalid API key"),
    (404, "unknown model or batch"), (429, "over one of this API key's limits"),
    (503, "Redis is unavailable (try again)"))}


def is_anthropic(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


class AnthropicError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message

    def body(self) -> dict:
        return {"type": "error", "error": {"type": TYPES.get(self.status, "api_error"), "message": self.message}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)
