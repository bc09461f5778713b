"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API, for
`client.responses.create`, `.stream` and `.parse` unchanged.

A response is an online request (api/online.py): one chat item on the high-priority queue.
The input (text, or items: messages with input_text / output_text / input_image parts,
function_call and function_call_output) becomes the job's chat, `instructions` a system
message first (a `developer` message is a system message too). `text.format` (json_schema
or json_object) is the answer's grammar; function tools and tool_choice are the chat's
(docs/openai.md, "Tool calling"). With `store` (the default) the response and its
conversation are kept FANOUT_RESULT_TTL: GET returns it, and `previous_response_id`
continues from it. Streamed, the events are the Responses API's typed ones; with tools the
output items come at the answer's end.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from results import events, keys
from results.reader import Rebuilder
from worker.engine.sampling_params import SamplingParams

from .. import online
from . import models
from .completions import error_of
from .errors import OpenAIError, not_found

router = APIRouter()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImage(_Strict):
    type: Literal["input_image"]
    image_url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


Part = Annotated[InputText | InputImage, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str
    id: str | None = None
    status: str | None = None


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="no effect")


class ResponseRequest(_Strict):
    model: str = Field(min_length=1)
    input: str | list[MessageItem | FunctionCallItem | FunctionOutputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=15)
    user: str | None = Field(None, max_length=512)
    truncation: Literal["disabled"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(None, description="no effect")
    safety_identifier: str | None = Field(None, description="no effect")
    prompt_cache_key: str | None = Field(None, description="no effect")


def chat_of(req: ResponseRequest, before: list[dict]) -> list[dict]:
    """The job's chat: the earlier response's conversation, instructions, then the input."""
    out = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + list(before)
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for i, it in enumerate(items):
        if isinstance(it, FunctionCallItem):
            call = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": it.arguments}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and out[-1]["content"] is None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(it, FunctionOutputItem):
            out.append({"role": "tool", "tool_call_id": it.call_id, "content": it.output})
        else:
            role = "system" if it.role == "developer" else it.role
            if isinstance(it.content, str):
                out.append({"role": role, "content": it.content})
                continue
            parts = [{"type": "text", "text": p.text} if isinstance(p, InputText)
                     else {"type": "image_url", "image_url": {"url": p.image_url}} for p in it.content]
            if role != "user" and any(p["type"] == "image_url" for p in parts):
                raise OpenAIError(400, f"input[{i}]: images only in a user message", param=f"input[{i}].content")
            text_only = all(p["type"] == "text" for p in parts)
            out.append({"role": role, "content": "".join(p["text"] for p in parts) if text_only else parts})
    return out


def params_of(req: ResponseRequest, settings) -> SamplingParams:
    given: dict[str, Any] = {"max_new_tokens": req.max_output_tokens or settings.max_new_tokens}
    names = {"max_new_tokens": "max_output_tokens", "json_schema": "text.format", "json_object": "text.format"}
    for field in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(req, field) is not None:
            given[field] = getattr(req, field)
    if req.tools:
        given["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                            "parameters": t.parameters, "strict": t.strict}}
                          for t in req.tools]
    if req.tool_choice is not None:
        c = req.tool_choice
        given["tool_choice"] = c if isinstance(c, str) else {"type": "function", "function": {"name": c.name}}
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise OpenAIError(400, "text.format.schema: required with type json_schema", param="text.format.schema")
        given["json_schema"] = fmt.schema_
    elif fmt is not None and fmt.type == "json_object":
        given["json_object"] = True
    if given["max_new_tokens"] > settings.max_new_tokens:
        raise OpenAIError(400, f"{given['max_new_tokens']} tokens is over this server's limit of "
                               f"{settings.max_new_tokens} (FANOUT_MAX_NEW_TOKENS)", param="max_output_tokens",
                          code="invalid_value")
    try:
        return SamplingParams(**given)
    except ValidationError as e:
        err = e.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        field = str(err["loc"][0]) if err["loc"] else msg.partition(":")[0]
        name = names.get(field, field) if field in SamplingParams.model_fields else None
        raise OpenAIError(400, msg if not err["loc"] else f"{name}: {msg}", param=name, code="invalid_value") from None


def _id(prefix: str, response_id: str, k: int = 0) -> str:
    """An output item's id, made from the response's (a retried attempt gives the same)."""
    return prefix + hashlib.blake2b(f"{response_id}:{k}".encode(), digest_size=12).hexdigest()


def _output(response_id: str, record: dict) -> list[dict]:
    calls = record.get("tool_calls") or []
    text = record.get("content") if record.get("tool_calls") is not None else record["text"]
    out = []
    if text or not calls:
        out.append({"type": "message", "id": _id("msg_", response_id), "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": text or "", "annotations": [], "logprobs": []}]})
    for k, c in enumerate(calls):
        out.append({"type": "function_call", "id": _id("fc_", response_id, k), "call_id": _id("call_", response_id, k),
                    "name": c["name"], "arguments": c["arguments"], "status": "completed"})
    return out


def _answer(response_id: str, record: dict) -> dict:
    """What a finished response says of its answer: status, output, usage."""
    u = record["usage"]
    cut = record["finish_reason"] == "length"
    return {"status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": _output(response_id, record),
            "usage": {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": u["cached_tokens"]},
                      "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}}


def _object(response_id: str, created: int, req: ResponseRequest, record: dict | None = None) -> dict:
    """The response object: in progress (no record yet) or finished with the record's answer."""
    answer = _answer(response_id, record) if record is not None else {
        "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
    return {"id": response_id, "object": "response", "created_at": created, "error": None, **answer,
            "instructions": req.instructions, "model": req.model,
            "max_output_tokens": req.max_output_tokens, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                                if req.text and req.text.format else {"type": "text"})},
            "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
            else req.tool_choice.model_dump(), "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "truncation": "disabled", "user": req.user, "metadata": req.metadata or {}}


def batch_body(response_id: str, created: int, model: str, record: dict) -> dict:
    """A batch line's response: the answer without the request's echo (instructions, tools,
    temperature...), which the batch does not keep; the input file has it by custom_id."""
    return {"id": response_id, "object": "response", "created_at": created, "error": None, "model": model,
            **_answer(response_id, record)}


def _load(redis, response_id: str, tenant) -> dict:
    raw = redis.get(keys.response(response_id))
    stored = json.loads(raw) if raw else None
    if stored is None or (tenant is not None and stored["tenant"] != tenant.id):
        raise not_found("response", response_id)
    return stored


def _keep(request: Request, response: dict, chat: list[dict], record: dict) -> None:
    """Store the response and its conversation (the answer as the assistant's turn)."""
    st, tenant = request.app.state, request.state.tenant
    calls = [{"id": o["call_id"], "type": "function", "function": {"name": o["name"], "arguments": o["arguments"]}}
             for o in response["output"] if o["type"] == "function_call"]
    text = next((o["content"][0]["text"] for o in response["output"] if o["type"] == "message"), None)
    turn = {"role": "assistant", "content": text if text or not calls else None, **({"tool_calls": calls} if calls else {})}
    st.redis.set(keys.response(response["id"]), json.dumps({"response": response, "chat": chat + [turn],
                                                           "tenant": tenant.id if tenant else None}),
                 ex=st.settings.result_ttl)


@router.post("/responses", response_model=None)
async def create(req: ResponseRequest, request: Request):
    """A response: the model's answer to the input (`stream: true`: typed server-sent events)."""
    st = request.app.state
    await anyio.to_thread.run_sync(models.require, st.redis, req.model)
    before = []
    if req.previous_response_id is not None:
        earlier = await anyio.to_thread.run_sync(_load, st.redis, req.previous_response_id, request.state.tenant)
        before = [m for m in earlier["chat"] if m["role"] != "system"]  # instructions are not carried over
    chat = chat_of(req, before)
    params = params_of(req, st.settings)
    if params.tools and params.effective_tool_choice == "auto":
        await anyio.to_thread.run_sync(models.require_tool_format, st.redis, req.model)
    metadata = {**(req.metadata or {}), **({"user": req.user} if req.user else {})}
    job = await online.start(request, req.model, {"messages": [chat]}, params, metadata, disconnect=not req.stream)
    response_id, created = "resp_" + job.job_id, int(time.time())
    try:
        if not req.stream:
            [[record]] = await online.collect(job.entries, 1, 1)
            response = _object(response_id, created, req, record)
            if req.store:
                await anyio.to_thread.run_sync(_keep, request, response, chat, record)
            return JSONResponse(response)
        first = await online.first_output(job.entries)
    except online.Failed as e:
        raise error_of(e.entry, "input") from None
    whole = bool(params.tools) and params.effective_tool_choice != "none"
    return StreamingResponse(_events(request, req, response_id, created, chat, first, job.entries, whole),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.get("/responses/{response_id}", response_model=None)
def retrieve(response_id: str, request: Request):
    """A stored response (created with `store`, the default)."""
    return _load(request.app.state.redis, response_id, request.state.tenant)["response"]


async def _events(request: Request, req: ResponseRequest, response_id: str, created: int, chat: list[dict],
                  first: list[dict], entries, whole: bool) -> AsyncIterator[str]:
    seq = 0

    def sse(kind: str, data: dict) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

    yield sse("response.created", {"response": _object(response_id, created, req)})
    yield sse("response.in_progress", {"response": _object(response_id, created, req)})
    msg_id, rebuilt, sent, opened, done = _id("msg_", response_id), Rebuilder(), 0, False, False
    where = {"item_id": msg_id, "output_index": 0, "content_index": 0}

    def open_message():
        item = {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant", "content": []}
        return [sse("response.output_item.added", {"output_index": 0, "item": item}),
                sse("response.content_part.added", {**where, "part": {"type": "output_text", "text": "",
                                                                      "annotations": [], "logprobs": []}})]

    async for e in online.replay(first, entries):  # to the job's end: closing it early would cancel the job
        if done:
            continue
        rebuilt.apply(e)
        if online.failure(e):
            err = error_of(e, "input")
            yield sse("error", {"code": err.code, "message": err.message, "param": err.param})
            return
        if e["type"] not in (events.DELTA, events.FINAL) or (whole and e["type"] == events.DELTA):
            continue
        if not whole:
            text = rebuilt.outputs[(e["index"], e["sample"])].text
            if not opened:
                for x in open_message():
                    yield x
                opened = True
            if len(text) > sent:  # (a retried attempt catches up with what was sent first)
                yield sse("response.output_text.delta", {**where, "delta": text[sent:], "logprobs": []})
                sent = len(text)
        if e["type"] != events.FINAL:
            continue
        record = online.record(e)
        response = _object(response_id, created, req, record)
        for k, item in enumerate(response["output"]):
            if item["type"] == "message":
                part = item["content"][0]
                if whole:
                    for x in open_message():
                        yield x
                    yield sse("response.output_text.delta", {**where, "delta": part["text"], "logprobs": []})
                yield sse("response.output_text.done", {**where, "text": part["text"], "logprobs": []})
                yield sse("response.content_part.done", {**where, "part": part})
            else:
                yield sse("response.output_item.added", {"output_index": k, "item": {**item, "arguments": "",
                                                                                     "status": "in_progress"}})
                yield sse("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": k,
                                                                     "delta": item["arguments"]})
                yield sse("response.function_call_arguments.done", {"item_id": item["id"], "output_index": k,
                                                                    "arguments": item["arguments"]})
            yield sse("response.output_item.done", {"output_index": k, "item": item})
        if req.store:
            await anyio.to_thread.run_sync(_keep, request, response, chat, record)
        yield sse("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                  {"response": response})
        done = True
