"""POST /v1/messages: Anthropic's Messages API. A message is a native job of one chat item
on the high-priority queue (api/online.py), answered as Anthropic's `message`, or streamed
in its events (message_start, content_block_start / _delta / _stop, message_delta,
message_stop; `error` when the request fails midway). With tools, the answer's blocks come
at its end (a call is known to be one only once it is whole), as the OpenAI routes do."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from results import events
from results.reader import Rebuilder

from .. import online, streams
from ..openai import models
from ..openai.errors import OpenAIError
from .errors import AnthropicError
from .schemas import Message_, MessagesRequest, message

router = APIRouter()


def failure(entry: dict) -> AnthropicError:
    """The stream entry that ended a request (online.Failed) as Anthropic's error."""
    if entry.get("type") == events.ERROR:
        return AnthropicError(400, entry["error"])
    if entry.get("type") == streams.CLOSED:
        return AnthropicError(401, f"{entry['reason']}: the request was canceled")
    return AnthropicError(500, f"the request's job {entry.get('status', 'ended')}: {entry.get('error') or 'no output'}")


async def prepare(request: Request, req: MessagesRequest) -> tuple[dict, object]:
    """The job's items and sampling params, checked against the served model."""
    st = request.app.state
    try:
        await anyio.to_thread.run_sync(models.require, st.redis, req.model)
        params = req.sampling_params(st.settings)
        if params.tools and params.effective_tool_choice == "auto":
            await anyio.to_thread.run_sync(models.require_tool_format, st.redis, req.model)
    except OpenAIError as e:
        raise AnthropicError(e.status, e.message) from None
    return {"messages": [req.chat()]}, params


@router.post("/messages", response_model=Message_, responses={200: {"content": {"text/event-stream": {}}}})
async def create(req: MessagesRequest, request: Request):
    """A message: the model's answer to the conversation (`stream: true`: Anthropic's events)."""
    items, params = await prepare(request, req)
    metadata = {"user": req.metadata.user_id} if req.metadata and req.metadata.user_id else {}
    job = await online.start(request, req.model, items, params, metadata, disconnect=not req.stream)
    msg_id = "msg_" + job.job_id
    try:
        if not req.stream:
            [[record]] = await online.collect(job.entries, 1, 1)
            return JSONResponse(message(msg_id, req.model, record))
        first = await online.first_output(job.entries)
    except online.Failed as e:
        raise failure(e.entry) from None
    whole = bool(params.tools) and params.effective_tool_choice != "none"
    return StreamingResponse(_events(msg_id, req.model, first, job.entries, whole), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def _blocks(msg: dict) -> list[str]:
    """A whole answer's content blocks as events (with tools)."""
    out = []
    for k, block in enumerate(msg["content"]):
        if block["type"] == "text":
            out.append(_sse("content_block_start", {"index": k, "content_block": {"type": "text", "text": ""}}))
            out.append(_sse("content_block_delta", {"index": k, "delta": {"type": "text_delta", "text": block["text"]}}))
        else:
            out.append(_sse("content_block_start", {"index": k, "content_block": {**block, "input": {}}}))
            out.append(_sse("content_block_delta", {"index": k, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))
        out.append(_sse("content_block_stop", {"index": k}))
    return out


async def _events(msg_id: str, model: str, first: list[dict], entries, whole: bool) -> AsyncIterator[str]:
    start = {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
    yield _sse("message_start", {"message": start})
    yield _sse("ping", {})
    rebuilt, sent, opened, done = Rebuilder(), 0, False, False

    async for e in online.replay(first, entries):  # to the job's end: closing it early would cancel the job
        if done:
            continue
        rebuilt.apply(e)
        if online.failure(e):
            yield _sse("error", {"error": failure(e).body()["error"]})
            return
        if e["type"] not in (events.DELTA, events.FINAL) or (whole and e["type"] == events.DELTA):
            continue
        if e["type"] == events.FINAL and whole:
            for event in _blocks(message(msg_id, model, online.record(e))):
                yield event
        else:
            text = rebuilt.outputs[(e["index"], e["sample"])].text
            if len(text) > sent:  # a retried attempt has caught up with what was sent
                if not opened:
                    yield _sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                    opened = True
                yield _sse("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text[sent:]}})
                sent = len(text)
        if e["type"] == events.FINAL:
            if opened:
                yield _sse("content_block_stop", {"index": 0})
            msg = message(msg_id, model, online.record(e))
            yield _sse("message_delta", {"delta": {"stop_reason": msg["stop_reason"], "stop_sequence": msg["stop_sequence"]},
                                         "usage": msg["usage"]})
            yield _sse("message_stop", {})
            done = True
