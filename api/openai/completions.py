"""POST /v1/chat/completions and /v1/completions: each request is a native job (one item
per prompt) on the high-priority queue, so interactive requests pass batch work; the HTTP
request waits on the job's stream. Streamed, every stream entry becomes OpenAI chunks at
once; a retried attempt (its worker died) regenerates the same tokens from the same seed,
and only what goes past the text already sent is sent. A client that goes away cancels
its job."""
from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from results import events
from results.reader import Rebuilder

from .. import online, streams, tokenize
from . import bodies, models
from .errors import OpenAIErrorResponse, OpenAIError
from .schemas import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, sampling_params

router = APIRouter()

FAILED = {500: {"model": OpenAIErrorResponse, "description": "the job failed (or was canceled through the job API)"}}


def _ok(model) -> dict:
    return {200: {"model": model, "description": "the object, or with `stream: true` server-sent chunks",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


@router.post("/chat/completions", response_model=None, responses={**_ok(ChatCompletion), **FAILED})
async def chat_completions(req: ChatCompletionRequest, request: Request):
    """A chat completion: the messages go through the model's chat template."""
    chats = [[m.job_message() for m in req.messages]]
    if any(m.image_parts() for m in req.messages):
        await anyio.to_thread.run_sync(models.require_images, request.app.state.redis, req.model, req.messages)
    return await _serve(request, req, {"messages": chats}, "chatcmpl-")


@router.post("/completions", response_model=None, responses={**_ok(Completion), **FAILED})
async def completions(req: CompletionRequest, request: Request):
    """A (legacy) completion: each prompt (text or token ids) is one item of the job."""
    p = req.prompt
    if isinstance(p, str):
        items = {"prompts": [p]}
    elif isinstance(p[0], str):
        items = {"prompts": p}
    elif isinstance(p[0], int):
        items = {"input_ids": [p]}
    else:
        items = {"input_ids": p}
    return await _serve(request, req, items, "cmpl-", echo=req.echo)


def _prompt_texts(redis, model: str, items: dict) -> list[str]:
    """Each item's prompt as text, to echo: as given, or token ids decoded by the model's
    tokenizer."""
    if "prompts" in items:
        return items["prompts"]
    tok, lock = tokenize.tokenizer(redis, model)
    with lock:
        return [tok.decode(ids) for ids in items["input_ids"]]


async def _serve(request: Request, req, items: dict, prefix: str, echo: bool = False):
    st = request.app.state
    size = len(next(iter(items.values())))
    if size > st.settings.max_batch:
        raise OpenAIError(400, f"{size} prompts, over this server's limit of {st.settings.max_batch} "
                               "(FANOUT_MAX_BATCH)", param="prompt", code="invalid_value")
    await anyio.to_thread.run_sync(models.require, st.redis, req.model)
    params = sampling_params(req, st.settings)
    if params.tools and params.effective_tool_choice == "auto":
        await anyio.to_thread.run_sync(models.require_tool_format, st.redis, req.model)
    metadata = {**(req.metadata or {}), **({"user": req.user} if req.user else {})}
    job = await online.start(request, req.model, items, params, metadata, disconnect=not req.stream)
    head = (prefix + job.job_id, int(time.time()), req.model)
    chat = prefix == "chatcmpl-"
    try:
        if not req.stream:
            found = await online.collect(job.entries, size, params.n)
            if chat:
                return JSONResponse(bodies.chat_completion(*head, found))
            texts = await anyio.to_thread.run_sync(_prompt_texts, st.redis, req.model, items) if echo else None
            return JSONResponse(bodies.text_completion(*head, found, texts))
        first = await online.first_output(job.entries)  # a prompt that cannot run still gets its 400
    except online.Failed as e:
        raise error_of(e.entry, "messages" if chat else "prompt") from None
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    # With tools, a choice's text is a call or not only once it is whole: it comes at its end.
    whole = chat and bool(params.tools) and params.effective_tool_choice != "none"
    return StreamingResponse(_chunks(chat, head, first, job.entries, size, params.n, include_usage, whole),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# An item's chat error, as the engine names it within a job: "messages[ITEM]: [message I: ]...".
_CHAT_ERROR = re.compile(r"messages\[0\]: (?:message (\d+): )?(.*)", re.S)


def error_of(entry: dict, field: str) -> OpenAIError:
    """The stream entry that ended an online request (online.Failed), as OpenAI's error;
    `field` is the request's input (`messages`, `prompt`, `input`), named as its param."""
    if entry.get("type") == events.ERROR:
        # A chat is the job's one item: name its message where the engine knows it.
        if field != "prompt" and (m := _CHAT_ERROR.fullmatch(entry["error"])):
            param = f"messages[{m.group(1)}]" if field == "messages" and m.group(1) is not None else field
            return OpenAIError(400, f"{param}: {m.group(2)}", param=param, code="invalid_prompt")
        return OpenAIError(400, entry["error"], param=field, code="invalid_prompt")
    if entry.get("type") == streams.CLOSED:
        return OpenAIError(401, f"{entry['reason']}: the request was canceled", code="revoked_api_key")
    return OpenAIError(500, f"the request's job {entry.get('status', 'ended')}: {entry.get('error') or 'no output'}",
                       type="server_error")


def _tool_chunks(head: tuple, c: int, record: dict) -> list[dict]:
    """A whole chat choice as chunks: its content (if any), one tool_calls delta per call
    (id, name and all of the arguments at once), and its finish_reason."""
    message, finish = bodies.chat_message(head[0], c, record)
    lps = record["logprobs"]
    out = []
    if message["content"] or lps:
        out.append(bodies.chat_chunk(*head, c, {"content": message["content"] or ""}, lps))
    for k, call in enumerate(message.get("tool_calls") or []):
        out.append(bodies.chat_chunk(*head, c, {"tool_calls": [{"index": k, **call}]}))
    out.append(bodies.chat_chunk(*head, c, {}, None, finish))
    return out


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _chunks(chat: bool, head: tuple, first: list[dict], entries, size: int, n: int,
                  include_usage: bool, whole: bool = False) -> AsyncIterator[str]:
    """`whole`: each choice comes in its final chunks (a chat with tools): its content, then
    its tool_calls deltas, then its finish_reason."""
    rebuilt, sent, finals = Rebuilder(), {}, {}
    extra = {"usage": None} if include_usage else {}  # OpenAI: every chunk has it then, null
    if chat:  # each choice opens with the assistant's role
        for c in range(size * n):
            yield _sse({**bodies.chat_chunk(*head, c, {"role": "assistant", "content": ""}), **extra})

    async for e in online.replay(first, entries):
        rebuilt.apply(e)
        kind = e["type"]
        if kind == streams.CLOSED:
            yield _sse(error_of(e, "messages" if chat else "prompt").body())  # no [DONE]: the answer is cut
            return
        if kind == events.ERROR or (events.is_terminal(e) and e["status"] != "succeeded"):
            yield _sse(error_of(e, "messages" if chat else "prompt").body())  # the other samples go on, unless the job ended
            if kind == events.ERROR:
                continue
            return
        if kind not in (events.DELTA, events.FINAL) or (whole and kind == events.DELTA):
            continue
        key = (e["index"], e["sample"])
        if whole:
            finals[key] = online.record(e)
            for chunk in _tool_chunks(head, key[0] * n + key[1], finals[key]):
                yield _sse({**chunk, **extra})
            continue
        out, (chars, tokens) = rebuilt.outputs[key], sent.get(key, (0, 0))
        text = out.text[chars:]
        lps = out.logprobs[tokens:] if out.logprobs is not None else None
        finish = e["finish_reason"] if kind == events.FINAL else None
        if kind == events.FINAL:
            finals[key] = online.record(e)
        if not (text or lps or finish):
            continue  # a retried attempt has not caught up with what was sent
        sent[key] = (len(out.text), len(out.logprobs or []))
        c = key[0] * n + key[1]
        if chat:
            chunk = bodies.chat_chunk(*head, c, {"content": text}, lps, finish)
        else:
            chunk = bodies.text_chunk(*head, c, text, lps, chars, finish)
        yield _sse({**chunk, **extra})
    if include_usage and len(finals) == size * n:
        items = [[finals[(i, j)] for j in range(n)] for i in range(size)]
        yield _sse({"id": head[0], "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": head[1], "model": head[2], "system_fingerprint": None, "choices": [],
                    "usage": bodies.usage(items)})
    yield "data: [DONE]\n\n"
