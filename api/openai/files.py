"""OpenAI files: batch input files (uploaded, validated line by line) and batch output and
error files (written when a batch ends).

They live in Redis, next to the jobs: the API is stateless (any process, on any host,
serves any file, with no shared volume to set up), the batch that reads a file and the
finalization that writes one can run in any API process, and Redis's append-only file
already makes the service's state durable. The cost is memory: a file takes its size in
Redis (input up to FANOUT_BATCH_MAX_FILE_BYTES); output files expire after
FANOUT_RESULT_TTL, input files when DELETEd (or after `expires_after`)."""
from __future__ import annotations

import json
import time
import uuid

import anyio
from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import Response

from redis.exceptions import WatchError

from results import keys

from ..tenants import OverLimit
from . import batchinput
from .errors import OpenAIError, not_found
from .schemas import FileDeleted, FileList, FileObject

router = APIRouter()

FORM = {"file", "purpose", "expires_after[anchor]", "expires_after[seconds]"}


def _tenant_id(tenant) -> str | None:
    return tenant.id if tenant else None


def save(redis, content: bytes, filename: str, purpose: str, tenant_id: str | None, ttl: int | None,
         file_id: str | None = None, quota: int | None = None) -> dict:
    """Store a file (under `file_id` if given: saving again replaces it); returns its object.
    `quota`: the tenant's file_bytes limit, checked against its live files of this purpose
    in the same transaction as the save (OverLimit past it)."""
    now = int(time.time())
    obj = {"id": file_id or "file-" + uuid.uuid4().hex, "object": "file", "bytes": len(content), "created_at": now,
           "filename": filename, "purpose": purpose, "status": "processed",
           "expires_at": now + ttl if ttl else None, "status_details": None}
    listed = keys.files(tenant_id)
    with redis.pipeline() as pipe:
        while True:
            try:
                if quota is not None:
                    pipe.watch(listed)  # an upload or delete of this tenant meanwhile: again
                    held = _held(pipe, listed, purpose)
                    if held + len(content) > quota:
                        pipe.reset()
                        raise OverLimit("file_bytes", f"{held} bytes of files kept and {len(content)} more, over "
                                                      f"this API key's limit of {quota} (file_bytes)")
                pipe.multi()
                pipe.set(keys.file_content(obj["id"]), content, ex=ttl)
                pipe.set(keys.file(obj["id"]), json.dumps({**obj, "tenant": tenant_id}), ex=ttl)
                pipe.zadd(listed, {obj["id"]: now})
                pipe.execute()
                return obj
            except WatchError:
                continue


def _held(pipe, listed: str, purpose: str) -> int:
    """Bytes of the listed files of `purpose` still there (expired ones count nothing)."""
    ids = [i.decode() for i in pipe.zrange(listed, 0, -1)]
    records = pipe.mget([keys.file(i) for i in ids]) if ids else []
    return sum(o["bytes"] for o in (json.loads(r) for r in records if r) if o["purpose"] == purpose)


def get(redis, file_id: str, tenant) -> dict:
    """The file's object; 404 for an unknown id or another tenant's file."""
    raw = redis.get(keys.file(file_id))
    obj = json.loads(raw) if raw else None
    if obj is None or obj.pop("tenant") != _tenant_id(tenant):
        raise not_found("file", file_id)
    return obj


def content(redis, file_id: str, tenant) -> bytes:
    get(redis, file_id, tenant)
    data = redis.get(keys.file_content(file_id))
    if data is None:  # expired between the two reads
        raise not_found("file", file_id)
    return data


@router.post("/files", response_model=FileObject)
async def upload(request: Request, file: UploadFile = File(description="JSONL, one request per line"),
                 purpose: str = Form(description="`batch`"),
                 anchor: str | None = Form(None, alias="expires_after[anchor]", description="`created_at`"),
                 seconds: int | None = Form(None, alias="expires_after[seconds]", ge=3600, le=30 * 24 * 3600)):
    """Upload a batch input file: every line is validated (400 names the lines at fault)."""
    st = request.app.state
    unknown = sorted(set((await request.form()).keys()) - FORM)
    if unknown:
        raise OpenAIError(400, f"Unrecognized request argument supplied: {unknown[0]}", unknown[0],
                          "unsupported_parameter")
    if purpose != "batch":
        raise OpenAIError(400, f"purpose {purpose!r}: only 'batch' files are supported here", "purpose")
    if (anchor is None) != (seconds is None) or anchor not in (None, "created_at"):
        raise OpenAIError(400, "expires_after: give anchor 'created_at' and seconds", "expires_after")
    data = await file.read(st.settings.batch_max_file_bytes + 1)
    if len(data) > st.settings.batch_max_file_bytes:
        raise OpenAIError(400, f"the file is over the limit of {st.settings.batch_max_file_bytes} bytes "
                               "(FANOUT_BATCH_MAX_FILE_BYTES)", "file")
    try:
        await anyio.to_thread.run_sync(batchinput.parse, data, st.settings)
    except batchinput.Invalid as e:
        raise OpenAIError(400, f"invalid batch file: {e}", "file", "invalid_file") from None
    tenant = request.state.tenant
    quota = tenant.limits.get("file_bytes") if tenant else None
    return await anyio.to_thread.run_sync(lambda: save(st.redis, data, file.filename or "batch.jsonl", "batch",
                                                       _tenant_id(tenant), seconds, quota=quota))


@router.get("/files", response_model=FileList)
def list_files(request: Request, after: str | None = Query(None), limit: int = Query(10000, ge=1, le=10000),
               order: str = Query("desc", pattern="^(asc|desc)$"), purpose: str | None = Query(None)):
    """Your files, newest first (`order=asc`: oldest first)."""
    redis, tenant = request.app.state.redis, request.state.tenant
    key = keys.files(_tenant_id(tenant))
    rank = getattr(redis, "zrank" if order == "asc" else "zrevrank")
    start = 0
    if after is not None:
        at = rank(key, after)
        if at is None:
            raise not_found("file", after)
        start = at + 1
    found, gone = [], []
    while len(found) <= limit:
        ids = [i.decode() for i in redis.zrange(key, start, start + 999, desc=order == "desc")]
        if not ids:
            break
        start += len(ids)
        for file_id, raw in zip(ids, redis.mget([keys.file(i) for i in ids])):
            if raw is None:
                gone.append(file_id)  # expired
                continue
            obj = json.loads(raw)
            obj.pop("tenant")
            if purpose is None or obj["purpose"] == purpose:
                found.append(obj)
    if gone:
        redis.zrem(key, *gone)
    data = found[:limit]
    return {"data": data, "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
            "has_more": len(found) > limit}


@router.get("/files/{file_id}", response_model=FileObject)
def get_file(file_id: str, request: Request):
    return get(request.app.state.redis, file_id, request.state.tenant)


@router.get("/files/{file_id}/content", response_class=Response, responses={
    200: {"content": {"application/jsonl": {"schema": {"type": "string"}}}, "description": "the file's bytes"}})
def file_content(file_id: str, request: Request):
    return Response(content(request.app.state.redis, file_id, request.state.tenant), media_type="application/jsonl")


@router.delete("/files/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, request: Request):
    redis, tenant = request.app.state.redis, request.state.tenant
    get(redis, file_id, tenant)
    with redis.pipeline() as pipe:
        pipe.delete(keys.file(file_id), keys.file_content(file_id))
        pipe.zrem(keys.files(_tenant_id(tenant)), file_id)
        pipe.execute()
    return {"id": file_id, "deleted": True}
