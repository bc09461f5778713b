"""OpenAI files: batch input files (uploaded, validated line by line) and batch output and
error files (written when a batch ends).

Their bytes live in the blob store (results/blobs.py: a folder, or an S3 bucket), their
objects in Redis (keys.file, a small JSON: listing and quotas stay Redis reads). Bytes
stream both ways and no process holds a whole file: an upload is spooled to disk by the
form parser, validated line by line, then copied into the store; a download streams from
it. A file's object expires (`expires_after`; FANOUT_RESULT_TTL for output files) or is
deleted first, its bytes after: keys.blobs_due says when, and every API process's sweep
(api/sweep.py) deletes the due ones, so bytes that a store that was down kept are deleted
once it is back, and bytes a process wrote before dying, with no object, are too."""
from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from typing import Iterable, Iterator

import anyio
from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import StreamingResponse

from redis.exceptions import WatchError

from results import blobs, keys

from ..tenants import OverLimit
from . import batchinput
from .errors import OpenAIError, not_found
from .schemas import FileDeleted, FileList, FileObject

log = logging.getLogger("fanout.api")
router = APIRouter()

FORM = {"file", "purpose", "expires_after[anchor]", "expires_after[seconds]"}


def _tenant_id(tenant) -> str | None:
    return tenant.id if tenant else None


def writing(redis, file_id: str) -> None:
    """Before writing the file's bytes: if no object follows (the writer died), the sweep
    deletes them."""
    redis.zadd(keys.blobs_due(), {keys.due_file(file_id): time.time() + blobs.ORPHAN})


def record(redis, store, file_id: str, size: int, filename: str, purpose: str, tenant_id: str | None,
           ttl: int | None, quota: int | None = None, sha256: str | None = None) -> dict:
    """The object of a file whose bytes are in the store (under `file_id`: again replaces
    it); returns it. `quota`: the tenant's file_bytes limit, checked against its live files
    of this purpose in the same transaction (OverLimit past it; the bytes are then swept)."""
    now = int(time.time())
    obj = {"id": file_id, "object": "file", "bytes": size, "created_at": now, "filename": filename,
           "purpose": purpose, "status": "processed", "expires_at": now + ttl if ttl else None,
           "status_details": None, "sha256": sha256}
    listed = keys.files(tenant_id)
    with redis.pipeline() as pipe:
        while True:
            try:
                if quota is not None:
                    pipe.watch(listed)  # an upload or delete of this tenant meanwhile: again
                    held = _held(pipe, listed, purpose)
                    if held + size > quota:
                        pipe.reset()
                        _drop(redis, store, file_id)
                        raise OverLimit("file_bytes", f"{held} bytes of files kept and {size} more, over "
                                                      f"this API key's limit of {quota} (file_bytes)")
                pipe.multi()
                pipe.set(keys.file(file_id), json.dumps({**obj, "tenant": tenant_id}), ex=ttl)
                pipe.zadd(listed, {file_id: time.time()})  # newest first, to the microsecond
                if ttl:
                    pipe.zadd(keys.blobs_due(), {keys.due_file(file_id): now + ttl})
                else:
                    pipe.zrem(keys.blobs_due(), keys.due_file(file_id))
                pipe.execute()
                return obj
            except WatchError:
                continue


def save(redis, store, chunks: Iterable[bytes], filename: str, purpose: str, tenant_id: str | None,
         ttl: int | None, quota: int | None = None) -> dict:
    """A new file of these bytes; returns its object, with `sha256` (kept in Redis, not
    shown: a dataset job's idempotency is its content's, api/submit.py)."""
    file_id = "file-" + uuid.uuid4().hex
    writing(redis, file_id)
    digest = hashlib.sha256()
    with store.writer(keys.file_blob(file_id)) as w:
        for chunk in chunks:
            digest.update(chunk)
            w.write(chunk)
    return record(redis, store, file_id, w.size, filename, purpose, tenant_id, ttl, quota, digest.hexdigest())


def _held(pipe, listed: str, purpose: str) -> int:
    """Bytes of the listed files of `purpose` still there (expired ones count nothing)."""
    ids = [i.decode() for i in pipe.zrange(listed, 0, -1)]
    records = pipe.mget([keys.file(i) for i in ids]) if ids else []
    return sum(o["bytes"] for o in (json.loads(r) for r in records if r) if o["purpose"] == purpose)


def _drop(redis, store, file_id: str) -> None:
    """Delete the bytes of a file without an object now, or leave them to the sweep."""
    redis.zadd(keys.blobs_due(), {keys.due_file(file_id): 0})
    try:
        store.delete(keys.file_blob(file_id))
    except blobs.StoreError as e:
        log.warning("files: %s; the sweep deletes %s later", e, file_id)
        return
    redis.zrem(keys.blobs_due(), keys.due_file(file_id))


def get(redis, file_id: str, tenant) -> dict:
    """The file's object; 404 for an unknown id or another tenant's file."""
    raw = redis.get(keys.file(file_id))
    obj = json.loads(raw) if raw else None
    if obj is None or obj.pop("tenant") != _tenant_id(tenant):
        raise not_found("file", file_id)
    return obj


def content(redis, store, file_id: str, tenant) -> Iterator[bytes]:
    """The file's bytes, in chunks (opened here: 404 or StoreError before the first)."""
    get(redis, file_id, tenant)
    try:
        return store.get(keys.file_blob(file_id))
    except blobs.Missing:  # expired between the two reads
        raise not_found("file", file_id) from None


def _chunks(f) -> Iterator[bytes]:
    f.seek(0)
    while chunk := f.read(blobs.CHUNK):
        yield chunk


@router.post("/files", response_model=FileObject)
async def upload(request: Request, file: UploadFile = File(description="JSONL, one request per line"),
                 purpose: str = Form(description="`batch`, or `dataset` (extension)"),
                 anchor: str | None = Form(None, alias="expires_after[anchor]", description="`created_at`"),
                 seconds: int | None = Form(None, alias="expires_after[seconds]", ge=3600, le=30 * 24 * 3600)):
    """Upload a batch input file (every line is validated: 400 names the lines at fault), or
    a native job's items (`purpose: dataset`, extension; checked by the job that names it)."""
    st = request.app.state
    unknown = sorted(set((await request.form()).keys()) - FORM)
    if unknown:
        raise OpenAIError(400, f"Unrecognized request argument supplied: {unknown[0]}", unknown[0],
                          "unsupported_parameter")
    if purpose not in ("batch", "dataset"):
        raise OpenAIError(400, f"purpose {purpose!r}: 'batch' files are supported here, and 'dataset' "
                               "(extension: a native job's items, POST /v1/jobs input_file_id)", "purpose")
    if (anchor is None) != (seconds is None) or anchor not in (None, "created_at"):
        raise OpenAIError(400, "expires_after: give anchor 'created_at' and seconds", "expires_after")
    # The form parser spooled the upload to a temporary file (to disk past 1 MiB).
    if file.size is None or file.size > st.settings.batch_max_file_bytes:
        raise OpenAIError(400, f"the file is over the limit of {st.settings.batch_max_file_bytes} bytes "
                               "(FANOUT_BATCH_MAX_FILE_BYTES)", "file")
    tenant = request.state.tenant
    quota = tenant.limits.get("file_bytes") if tenant else None

    def check_and_save():
        if purpose == "batch":  # a dataset's lines are checked by the job that names it
            batchinput.check(blobs.lines(_chunks(file.file)), st.settings)
        return save(st.redis, st.blobs, _chunks(file.file), file.filename or f"{purpose}.jsonl", purpose,
                    _tenant_id(tenant), seconds, quota=quota)

    try:
        return await anyio.to_thread.run_sync(check_and_save)
    except batchinput.Invalid as e:
        raise OpenAIError(400, f"invalid batch file: {e}", "file", "invalid_file") from None


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


@router.get("/files/{file_id}/content", response_class=StreamingResponse, responses={
    200: {"content": {"application/jsonl": {"schema": {"type": "string"}}}, "description": "the file's bytes"}})
def file_content(file_id: str, request: Request):
    st = request.app.state
    size = get(st.redis, file_id, request.state.tenant)["bytes"]
    return StreamingResponse(content(st.redis, st.blobs, file_id, request.state.tenant),
                             media_type="application/jsonl", headers={"Content-Length": str(size)})


@router.delete("/files/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, request: Request):
    st, tenant = request.app.state, request.state.tenant
    get(st.redis, file_id, tenant)
    with st.redis.pipeline() as pipe:
        pipe.delete(keys.file(file_id))
        pipe.zrem(keys.files(_tenant_id(tenant)), file_id)
        pipe.execute()
    _drop(st.redis, st.blobs, file_id)
    return {"id": file_id, "deleted": True}
