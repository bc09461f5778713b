"""Anthropic's Message Batches: POST/GET /v1/messages/batches, GET .../{id}, .../{id}/results,
POST .../{id}/cancel, DELETE .../{id}.

A message batch is one native job (normal priority): each request an item (its chat, its
own sampling params, its custom_id). Its object is built from the job at each read: the
processing status (`in_progress`, `canceling` once a cancel is asked until the job stops,
`ended`) and the request counts from the job's progress. The batch's own record (model,
creation, cancel time) and the tenant's listing live in Redis as long as the job's results
(FANOUT_RESULT_TTL). Results are the job's stored samples, read a page at a time and
written as Anthropic's JSONL, in the requests' order. Requests not run when a batch is
canceled are `canceled`; batches do not expire after 24 hours here (nothing is `expired`).
"""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Annotated, Literal

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from results import events, keys, progress, store

from .. import jobs
from ..openai import models
from ..openai.errors import OpenAIError
from ..schemas import JobRequest
from .errors import AnthropicError
from .schemas import MessagesRequest, message

router = APIRouter()

PAGE = 1000  # results read from the store at a time


class MessageBatchParams(MessagesRequest):
    stream: Literal[False] = False


class MessageBatchRequest(BaseModel):
    custom_id: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    params: MessageBatchParams


class MessageBatchCreate(BaseModel):
    requests: Annotated[list[MessageBatchRequest], Field(min_length=1)]


class MessageBatchCounts(BaseModel):
    processing: int
    succeeded: int
    errored: int
    canceled: int
    expired: int


class MessageBatch(BaseModel):
    id: str
    type: Literal["message_batch"] = "message_batch"
    processing_status: Literal["in_progress", "canceling", "ended"]
    request_counts: MessageBatchCounts
    ended_at: str | None
    created_at: str
    expires_at: str
    archived_at: str | None = None
    cancel_initiated_at: str | None
    results_url: str | None


class MessageBatchList(BaseModel):
    data: list[MessageBatch]
    has_more: bool
    first_id: str | None
    last_id: str | None


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def _job_id(batch_id: str) -> str:
    return batch_id.removeprefix("msgbatch_")


def _owned(redis, batch_id: str, tenant) -> dict:
    raw = redis.get(keys.message_batch(_job_id(batch_id))) if batch_id.startswith("msgbatch_") else None
    record = json.loads(raw) if raw else None
    if record is None or (tenant is not None and record["tenant"] != tenant.id):
        raise AnthropicError(404, f"No such message batch: '{batch_id}'")
    return record


def public(request: Request, record: dict) -> dict:
    """The batch object, from its record and its job's progress now."""
    redis, job_id = request.app.state.redis, _job_id(record["id"])
    status, times = jobs.status_of(redis, job_id)
    info = progress.read(redis, job_id) or {"total": record["requests"], "done": 0, "failed": 0}
    ended = status in events.TERMINAL
    left = info["total"] - info["done"]
    counts = {"processing": 0 if ended else left, "succeeded": info["done"] - info["failed"],
              "errored": info["failed"], "canceled": left if ended else 0, "expired": 0}
    return {"id": record["id"], "type": "message_batch",
            "processing_status": "ended" if ended else "canceling" if record.get("cancel_initiated_at") else "in_progress",
            "request_counts": counts, "created_at": _rfc3339(record["created_at"]),
            "expires_at": _rfc3339(record["created_at"] + 24 * 3600), "archived_at": None,
            "ended_at": times["ended_at"] if ended else None,
            "cancel_initiated_at": _rfc3339(record["cancel_initiated_at"]) if record.get("cancel_initiated_at") else None,
            "results_url": f"{str(request.base_url).rstrip('/')}/v1/messages/batches/{record['id']}/results" if ended else None}


def _create(request: Request, body: MessageBatchCreate) -> dict:
    st, tenant = request.app.state, request.state.tenant
    reqs = body.requests
    model = reqs[0].params.model
    for i, r in enumerate(reqs):
        if r.params.model != model:
            raise AnthropicError(400, f"requests.{i}.params.model: every request of a batch names the same model "
                                      f"({model!r}); this fleet serves one model per batch")
    seen = set()
    for i, r in enumerate(reqs):
        if r.custom_id in seen:
            raise AnthropicError(400, f"requests.{i}.custom_id: {r.custom_id!r} is used twice")
        seen.add(r.custom_id)
    try:
        models.require(st.redis, model)
    except OpenAIError as e:
        raise AnthropicError(e.status, e.message) from None
    chats, params = [], []
    for i, r in enumerate(reqs):
        try:
            chats.append(r.params.chat())
            params.append(r.params.sampling_params(st.settings))
        except AnthropicError as e:
            raise AnthropicError(e.status, f"requests.{i}.params.{e.message}") from None
    job_id, now = jobs.new_id(), time.time()
    record = {"id": "msgbatch_" + job_id, "model": model, "created_at": now, "requests": len(reqs),
              "tenant": tenant.id if tenant else None}
    # The record first: a batch whose job was refused (a limit) is never listed, its record expires.
    st.redis.set(keys.message_batch(job_id), json.dumps(record), ex=st.settings.result_ttl)
    jobs.submit(st.redis, JobRequest(messages=chats, custom_ids=[r.custom_id for r in reqs], sampling_params=params,
                                     metadata={"anthropic_batch": record["id"]}, model=model),
                st.settings, job_id=job_id, tenant=tenant, store=st.blobs)
    listing = keys.message_batches(record["tenant"])
    st.redis.zadd(listing, {record["id"]: time.time()})  # newest first, to the microsecond
    st.redis.expire(listing, st.settings.result_ttl)
    return public(request, record)


@router.post("/messages/batches", response_model=MessageBatch)
async def create(body: MessageBatchCreate, request: Request):
    """A batch of Messages requests, each with its custom_id, run as one job."""
    return await anyio.to_thread.run_sync(_create, request, body)


@router.get("/messages/batches", response_model=MessageBatchList)
def list_batches(request: Request, limit: int = Query(20, ge=1, le=1000), after_id: str | None = None,
                 before_id: str | None = None):
    """Your batches, newest first (after_id: the page after it; before_id: the page before it)."""
    redis = request.app.state.redis
    key = keys.message_batches(request.state.tenant.id if request.state.tenant else None)
    ids = [i.decode() for i in redis.zrange(key, 0, -1, desc=True)]
    if after_id is not None:
        ids = ids[ids.index(after_id) + 1:] if after_id in ids else []
    if before_id is not None:
        ids = ids[:ids.index(before_id)][-limit:] if before_id in ids else []
    page, more = ids[:limit], len(ids) > limit
    raws = redis.mget([keys.message_batch(_job_id(i)) for i in page]) if page else []
    data = [public(request, json.loads(r)) for r in raws if r]
    return {"data": data, "has_more": more, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


@router.get("/messages/batches/{batch_id}", response_model=MessageBatch)
def retrieve(batch_id: str, request: Request):
    return public(request, _owned(request.app.state.redis, batch_id, request.state.tenant))


@router.post("/messages/batches/{batch_id}/cancel", response_model=MessageBatch)
def cancel(batch_id: str, request: Request):
    """`canceling` until the job has stopped, then `ended`; the requests that finished keep
    their results, the others are `canceled`."""
    st = request.app.state
    record = _owned(st.redis, batch_id, request.state.tenant)
    status, _ = jobs.status_of(st.redis, _job_id(batch_id))
    if status not in events.TERMINAL and not record.get("cancel_initiated_at"):
        record["cancel_initiated_at"] = time.time()
        st.redis.set(keys.message_batch(_job_id(batch_id)), json.dumps(record), keepttl=True)
        jobs.cancel(st.redis, _job_id(batch_id), st.settings)
    return public(request, record)


@router.delete("/messages/batches/{batch_id}")
def delete(batch_id: str, request: Request):
    """An ended batch is forgotten (its results go with its job's, at their expiry)."""
    st = request.app.state
    record = _owned(st.redis, batch_id, request.state.tenant)
    if public(request, record)["processing_status"] != "ended":
        raise AnthropicError(400, f"message batch {batch_id} is still being processed: cancel it first")
    st.redis.delete(keys.message_batch(_job_id(batch_id)))
    st.redis.zrem(keys.message_batches(record["tenant"]), batch_id)
    return {"id": batch_id, "type": "message_batch_deleted"}


@router.get("/messages/batches/{batch_id}/results", response_class=StreamingResponse,
            responses={200: {"content": {"application/x-jsonl": {}}}})
def results(batch_id: str, request: Request):
    """One JSON line per request, in the batch's order: succeeded (its message), errored,
    or canceled."""
    st = request.app.state
    record = _owned(st.redis, batch_id, request.state.tenant)
    if public(request, record)["processing_status"] != "ended":
        raise AnthropicError(400, f"message batch {batch_id} has not ended yet: its results come once it has")
    job_id, model = _job_id(batch_id), record["model"]
    info = progress.read(st.redis, job_id)
    if info is None:
        raise AnthropicError(404, f"the results of message batch {batch_id} have expired")

    def lines():
        for offset in range(0, len(info["ns"]), PAGE):
            out = []
            for item in store.page(st.redis, st.blobs, job_id, info, offset, PAGE):
                out.append(json.dumps({"custom_id": item["custom_id"], "result": _result(job_id, model, item)}))
            yield ("\n".join(out) + "\n").encode()
    return StreamingResponse(lines(), media_type="application/x-jsonl")


def _result(job_id: str, model: str, item: dict) -> dict:
    samples = item["samples"]
    if not samples:
        return {"type": "canceled"}
    r = samples[0]
    if r["finish_reason"] == "error":
        return {"type": "errored", "error": {"type": "error", "error": {"type": "invalid_request_error",
                                                                         "message": r["error"] or "error"}}}
    return {"type": "succeeded", "message": message(f"msg_{job_id}_{item['index']}", model, r)}
