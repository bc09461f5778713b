"""POST /v1/embeddings in OpenAI's shape: each input is one item of an embedding job (task
embed) on the high-priority queue, run by the workers of an embedding model; the HTTP
request waits on the job's stream, as a completion does (api/online.py).

Extensions (vLLM's): `truncate_prompt_tokens`. `dimensions` is taken for a model trained
for shorter vectors (its config's `matryoshka_dimensions` or `is_matryoshka`), else a 400.
"""
from __future__ import annotations

import array
import base64
import sys
from typing import Annotated, Literal

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from jobs.spec import Text
from results import events, store
from worker.embedder.params import EmbedParams
from worker.engine.sampling_params import TokenId

from .. import online
from . import models
from .completions import FAILED, error_of
from .errors import OpenAIError
from .schemas import MetadataKey, MetadataValue, Strict

router = APIRouter()

Texts = Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1)]
Ids = Annotated[list[TokenId], Field(min_length=1)]


class EmbeddingRequest(Strict):
    model: str = Field(min_length=1, description="an embedding model that GET /v1/models lists")
    input: Annotated[Text, Field(min_length=1)] | Texts | Ids | Annotated[list[Ids], Field(min_length=1)] = Field(
        description="a text, texts, one input's token ids, or a list of those; each one vector")
    encoding_format: Literal["float", "base64"] = Field("float", description=(
        "float: lists of numbers; base64: each vector's float32 values, little-endian, base64"))
    dimensions: int | None = Field(None, ge=1, description=(
        "a shorter vector, for a model trained for it (Matryoshka); else a 400"))
    user: str | None = Field(None, max_length=512, description="kept in the job's metadata as `user`")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description=(
        "extension (vLLM's): an input longer than this keeps its first tokens (-1: the model's "
        "longest); unset, an input past the model's context is a 400 naming it"))
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=15, description=(
        "extension: kept in the job's metadata"))

    def items(self) -> dict:
        """The job's items: `prompts` or `input_ids`."""
        x = self.input
        if isinstance(x, str):
            return {"prompts": [x]}
        if isinstance(x[0], str):
            return {"prompts": x}
        if isinstance(x[0], int):
            return {"input_ids": [x]}
        return {"input_ids": x}

    def params(self) -> EmbedParams:
        try:
            return EmbedParams(dimensions=self.dimensions, truncate_prompt_tokens=self.truncate_prompt_tokens)
        except ValueError as e:
            raise OpenAIError(400, f"truncate_prompt_tokens: {e.errors()[0]['msg']}",
                              param="truncate_prompt_tokens", code="invalid_value") from None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 (encoding_format)")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def encoded(v: str | list[float], encoding_format: str) -> str | list[float]:
    """A vector as stored (base64) or read back (floats), in `encoding_format`."""
    if encoding_format == "float":
        return store.vector(v) if isinstance(v, str) else v
    if isinstance(v, str):
        return v
    a = array.array("f", v)
    if sys.byteorder == "big":
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode()


def body(model: str, records: list[dict], encoding_format: str) -> dict:
    """The response's body from each input's sample record (in input order)."""
    tokens = sum(r["usage"]["prompt_tokens"] for r in records)
    data = [{"object": "embedding", "index": i, "embedding": encoded(r["embedding"], encoding_format)}
            for i, r in enumerate(records)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/embeddings", response_model=EmbeddingList, responses=FAILED)
async def embeddings(req: EmbeddingRequest, request: Request):
    """One vector per input, on an embedding model's workers."""
    st = request.app.state
    items = req.items()
    size = len(next(iter(items.values())))
    if size > st.settings.max_batch:
        raise OpenAIError(400, f"{size} inputs, over this server's limit of {st.settings.max_batch} "
                               "(FANOUT_MAX_BATCH)", param="input", code="invalid_value")
    params = req.params()
    await anyio.to_thread.run_sync(models.require, st.redis, req.model, "embed")
    await anyio.to_thread.run_sync(models.require_dimensions, st.redis, req.model, req.dimensions)
    metadata = {**(req.metadata or {}), **({"user": req.user} if req.user else {})}
    job = await online.start(request, req.model, items, params, metadata)
    try:
        found = await online.collect(job.entries, size, 1)
    except online.Failed as e:
        raise _error(e.entry, size) from None
    return JSONResponse(body(req.model, [s[0] for s in found], req.encoding_format))


def _error(entry: dict, size: int) -> OpenAIError:
    """An input that could not be embedded is named: input[i] (of a list) or input."""
    if entry.get("type") == events.ERROR:
        where = "input" if size == 1 else f"input[{entry['index']}]"
        return OpenAIError(400, f"{where}: {entry['error']}", param=where, code="invalid_value")
    return error_of(entry, "input")
