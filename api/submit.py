"""Job routes: submit, status, results, events (SSE), cancel.

Every lookup goes to Redis by job id, so any API process serves any job.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from typing import Iterator, Literal

import anyio
import redis
from fastapi import APIRouter, Header, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, StreamingResponse
from starlette.background import BackgroundTask

from jobs import models as fleet
from results import events, keys, progress, store

from . import dataset, jobs, streams, validation
from .batchfile import BatchFileError, write_results
from .lease import Lease
from .openai import files
from .openai.errors import OpenAIError

from .schemas import Canceled, ErrorOut, JobCreated, JobInfo, JobList, JobRequest, ResultsPage, Status

router = APIRouter(prefix="/v1")

NOT_FOUND = {404: {"model": ErrorOut, "description": "unknown (or expired) job id"}}
STREAM_ID = re.compile(r"(\d{1,20})(?:-(\d{1,20}))?")  # Redis: <ms>-<seq>, each a 64-bit unsigned


def _stream_id(value: str) -> bool:
    m = STREAM_ID.fullmatch(value)  # fullmatch: `$` would let a trailing newline through
    return m is not None and all(int(g or 0) < 1 << 64 for g in m.groups())


def _state(request: Request):
    return request.app.state


def _not_found(job_id: str) -> HTTPException:
    return HTTPException(404, f"job not found: {job_id}")


def _replay(redis, stored: dict, body_hash: str) -> dict:
    if stored["hash"] != body_hash:
        raise HTTPException(409, "Idempotency-Key was used before with a different body")
    try:  # the claim and its job were written together; the job outlives the claim
        status, _ = jobs.status_of(redis, stored["id"])
    except jobs.JobNotFound:
        raise _not_found(stored["id"]) from None
    items = stored["items"]
    if items is None and status != "validating":  # a dataset job's, claimed before it was read
        items = int(redis.hget(keys.info(stored["id"]), "total") or 0)
    return {"id": stored["id"], "status": status, "stream": keys.stream(stored["id"]),
            "seed": stored["seed"], "items": items}


@router.post("/jobs", status_code=202, response_model=JobCreated, responses={
    400: {"model": ErrorOut, "description": "the body is not UTF-8 (FastAPI cannot decode it), or `model` is missing "
                                           "while the fleet serves several models, or is another task's"},
    403: {"model": ErrorOut, "description": "`priority: high` without the right (`fanout keys create --high-priority`)"},
    404: {"model": ErrorOut, "description": "`model` names no model of the fleet (the detail lists the served ones)"},
    409: {"model": ErrorOut, "description": "Idempotency-Key reused with a different body"},
})
def submit(req: JobRequest, request: Request, response: Response,
           idempotency_key: str | None = Header(None, max_length=256, description=(
               "a retried POST with the same key (and body) returns the same job"))):
    """Submit a batch job: its items, or a dataset of them (`input_file_id`, `input_url`).
    Returns once the job is queued; a dataset's job at once, `validating` while its lines
    are checked and laid out, then queued (or failed, naming the lines at fault). The job
    runs when a worker takes it."""
    st, tenant = _state(request), request.state.tenant
    # The body's own limits before the fleet's: an over-long batch is the same 422 whether or
    # not a worker serves its model now (the model's 404 came first).
    spec = None
    if req.input is None:
        spec = req.spec()
        jobs.check_limits(req, spec, st.settings)
    try:
        req = req.model_copy(update={"model": jobs.model_of(st.redis, req).name})
    except fleet.ModelError as e:
        raise HTTPException(e.status, e.message) from None
    f = _dataset_file(st, req, tenant) if req.input_file_id is not None else None
    idempotency = None
    if idempotency_key is not None:
        # A dataset file's job is its content's, not its id's: the same lines uploaded again
        # (a resumed `fanout submit`) with the same fields are the same job. A URL's is the URL.
        same = req.model_copy(update={"input_file_id": f"sha256:{f.get('sha256')}"}) if f else req
        idempotency = (idempotency_key, hashlib.sha256(same.model_dump_json().encode()).hexdigest())
    req = req.model_copy(update={"webhook_url": st.webhooks.target(req.webhook_url, tenant)})
    try:
        if req.input is not None:
            body = _submit_dataset(st, req, idempotency, tenant)
        else:
            body = jobs.submit(st.redis, req, st.settings, spec=spec, idempotency=idempotency, tenant=tenant,
                               store=st.blobs)
    except jobs.Claimed as e:
        body = _replay(st.redis, e.stored, idempotency[1])
        response.headers["Idempotent-Replayed"] = "true"
    response.headers["Location"] = f"/v1/jobs/{body['id']}"
    return body


def _dataset_file(st, req: JobRequest, tenant) -> dict:
    """The file `input_file_id` names: 422 unless it is one of this key's dataset files."""
    try:
        f = files.get(st.redis, req.input_file_id, tenant)
    except OpenAIError:
        f = None
    if f is None or f["purpose"] != "dataset":
        why = "no such file" if f is None else f"a {f['purpose']!r} file, not a 'dataset' one"
        raise RequestValidationError([{"loc": ("body", "input_file_id"), "type": "value_error",
                                       "msg": f"{why} (upload it with POST /v1/files, purpose dataset)"}])
    return f


def _submit_dataset(st, req: JobRequest, idempotency, tenant) -> dict:
    """A job whose items are a dataset's lines or rows (api/dataset.py): `validating` at
    once, checked and queued in a thread of this process (api/validation.py). A URL that
    names nothing readable is a 422 here."""
    if req.input_url is not None:
        chunks = dataset.open_url(req.input_url, st.settings, st.blobs, tenant)
        getattr(chunks, "close", lambda: None)()  # read again by the validation
    body = validation.start(st.redis, req, st.settings, tenant, idempotency)
    lease = Lease(st.redis, keys.validation(body["id"]), st.settings.validation_lease)
    if lease.take():  # else a sweep found it first and validates it
        validation.spawn(st.redis, st.blobs, st.settings, body["id"], lease)
    return body


@router.get("/jobs", response_model=JobList)
def list_jobs(request: Request, after: str | None = Query(None, description="the `last_id` of the previous page"),
              limit: int = Query(20, ge=1, le=100), status: Status | None = Query(None)):
    """Your jobs (every job without API keys), newest first, `limit` at a time; `status` filters."""
    try:
        data, more = jobs.listing(_state(request).redis, request.state.tenant, after, limit, status)
    except jobs.JobNotFound:
        raise RequestValidationError([{"loc": ("query", "after"), "type": "value_error",
                                       "msg": f"not a job of this listing (or expired): {after}"}]) from None
    return {"data": data, "has_more": more, "last_id": data[-1]["id"] if data else None}


@router.get("/jobs/{job_id}", response_model=JobInfo, responses=NOT_FOUND)
def get_job(job_id: str, request: Request):
    """Status, progress (items done / total), usage, error."""
    try:
        jobs.owned(_state(request).redis, job_id, request.state.tenant)
        return jobs.describe(_state(request).redis, job_id)
    except jobs.JobNotFound:
        raise _not_found(job_id) from None


def _info(request: Request, job_id: str) -> tuple[str, dict]:
    """(status, progress.read's info) of a job the caller owns; 404 if none."""
    redis = _state(request).redis
    try:
        jobs.owned(redis, job_id, request.state.tenant)
        status, _ = jobs.status_of(redis, job_id)
        info = progress.read(redis, job_id)
    except jobs.JobNotFound:
        info = None
    if info is None:
        raise _not_found(job_id)
    return status, info


@router.get("/jobs/{job_id}/results", response_model=ResultsPage, responses=NOT_FOUND)
def get_results(job_id: str, request: Request, offset: int = Query(0, ge=0),
                limit: int = Query(100, ge=1, le=1000)):
    """Finished samples, by item index; `next_offset` is null on the last page."""
    st = _state(request)
    status, info = _info(request, job_id)
    items = store.page(st.redis, st.blobs, job_id, info, offset, limit)
    end = offset + limit
    return {"id": job_id, "status": status, "offset": offset, "limit": limit, "total": info["total"],
            "next_offset": end if end < info["total"] else None, "items": items}


OUTPUT_PAGE = 1000  # items read at a time for GET /output


@router.get("/jobs/{job_id}/output", responses={
    200: {"description": "every item in index order, as /results gives them: JSONL (one item per line) or "
                         "Parquet (one row per item: index, custom_id, samples)",
          "content": {"application/jsonl": {}, "application/vnd.apache.parquet": {}}},
    **NOT_FOUND})
def get_output(job_id: str, request: Request, format: Literal["jsonl", "parquet"] | None = Query(
        None, description="default: the dataset's own (a Parquet dataset's job: parquet), else jsonl; "
                          "`parquet` needs pyarrow on the API (pip install pyarrow: the parquet extra)")):
    """The whole job's results as one file, read a page at a time from Redis and the blob
    store: complete once the job has ended; while it runs, its unfinished items have no samples."""
    st = _state(request)
    _, info = _info(request, job_id)
    format = format or info["input_format"] or "jsonl"

    def items() -> Iterator[dict]:
        for offset in range(0, len(info["ns"]), OUTPUT_PAGE):
            yield from store.page(st.redis, st.blobs, job_id, info, offset, OUTPUT_PAGE)

    name = f"fanout-{job_id}.{format}"
    headers = {"Content-Disposition": f'attachment; filename="{name}"'}
    if format == "jsonl":
        # One chunk per page, not per line: Starlette sends a sync iterator's every chunk
        # through its thread pool, which capped a line per chunk at ~5,000 lines/s.
        def pages() -> Iterator[bytes]:
            for offset in range(0, len(info["ns"]), OUTPUT_PAGE):
                page = store.page(st.redis, st.blobs, job_id, info, offset, OUTPUT_PAGE)
                yield "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in page).encode()
        return StreamingResponse(pages(), media_type="application/jsonl", headers=headers)
    # Parquet's footer comes last: written to a temporary file, a batch of rows at a time, then sent.
    spool = tempfile.NamedTemporaryFile(prefix="fanout-output-", suffix=".parquet", delete=False)
    spool.close()
    try:
        write_results(items(), spool.name, info["task"] == "embed")
    except BatchFileError as e:
        os.unlink(spool.name)
        raise RequestValidationError([{"loc": ("query", "format"), "type": "value_error", "msg": str(e)}]) from None
    except BaseException:
        os.unlink(spool.name)
        raise
    return FileResponse(spool.name, media_type="application/vnd.apache.parquet", filename=name,
                        background=BackgroundTask(os.unlink, spool.name))


@router.post("/jobs/{job_id}/cancel", status_code=202, response_model=Canceled, responses={
    **NOT_FOUND, 409: {"model": ErrorOut, "description": "the job already ended"}})
def cancel_job(job_id: str, request: Request):
    """Cancel: a queued job at once; a running one within one engine step of its worker
    (status stays `running` until then). Finished samples are kept."""
    st = _state(request)
    try:
        jobs.owned(st.redis, job_id, request.state.tenant)
        before, _ = jobs.status_of(st.redis, job_id)
        if before in ("succeeded", "failed", "canceled"):
            raise HTTPException(409, f"job already {before}")
        return {"id": job_id, "status": jobs.cancel(st.redis, job_id, st.settings)}
    except jobs.JobNotFound:
        raise _not_found(job_id) from None


def _sse(entry_id: str, entry: dict) -> str:
    return f"id: {entry_id}\nevent: {entry['type']}\ndata: {json.dumps(entry)}\n\n"


@router.get("/jobs/{job_id}/events", responses={
    200: {"description": "Server-sent events: one per stream entry (`id` = stream entry id, `event` = "
                         "entry type, `data` = the entry as JSON); ends after the terminal status; a "
                         "comment every FANOUT_SSE_KEEPALIVE seconds when idle",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    **NOT_FOUND})
async def job_events(job_id: str, request: Request,
                     last_event_id: str | None = Header(None, description="resume after this stream id"),
                     after: str | None = Query(None, description="same as Last-Event-ID, for clients "
                                                                 "that cannot set headers")):
    """Relay the job's stream from the start, or after `Last-Event-ID`."""
    st = _state(request)
    start = last_event_id or after or "0"
    if not _stream_id(start):
        where = ("header", "last-event-id") if last_event_id else ("query", "after")
        raise RequestValidationError([{"loc": where, "type": "value_error",
                                       "msg": f"not a stream entry id (<ms>-<seq>): {start!r}"}])
    try:
        await anyio.to_thread.run_sync(jobs.owned, st.redis, job_id, request.state.tenant)
        await anyio.to_thread.run_sync(jobs.status_of, st.redis, job_id)
    except jobs.JobNotFound:
        raise _not_found(job_id) from None
    # Only a job that keeps its items in the blob store has its stream trimmed (jobs/shards.py).
    trims = await st.aredis.hget(keys.info(job_id), "items_in") == b"store"

    key = keys.stream(job_id)
    follower = st.hub.open(key, start, streams.tenant_id(request))  # a 503 past the limit

    async def relay():
        last, told = start, None
        try:
            while True:
                try:
                    batch = await follower.next(st.settings.sse_keepalive)
                    trimmed = await _trimmed(st, job_id) if trims and batch else None
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    # Redis or this process is going away (shutdown): end the stream; the
                    # client resumes with Last-Event-ID on another API process.
                    return
                if follower.closed:
                    yield f"event: {streams.CLOSED}\ndata: {json.dumps(streams.closing(follower))}\n\n"
                    return
                if not batch:
                    yield ": keep-alive\n\n"
                    done = await anyio.to_thread.run_sync(ended, st, job_id)
                    if done and not await follower.read(1):
                        return  # resumed after the terminal entry: the client has the end
                    continue
                out = [(entry_id, events.decode(fields)) for entry_id, fields in batch]
                told = events.tell_trimmed(out, last, trimmed, told, job_id)
                last = out[-1][0]
                for entry_id, entry in out:
                    yield _sse(entry_id, entry)
                    if events.is_terminal(entry):
                        return
        finally:
            follower.close()

    return StreamingResponse(relay(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _trimmed(st, job_id: str) -> str | None:
    """The newest entry trimmed off the job's stream (jobs/shards.py), read after a batch:
    a follower whose last entry is older may have missed entries (of shards that finished:
    their items are in /results)."""
    trimmed = await st.aredis.hget(keys.info(job_id), "trimmed")
    return trimmed.decode() if trimmed is not None else None


def ended(st, job_id: str) -> bool:
    """Whether the job has ended (its terminal entry is on the stream), or expired."""
    try:
        status, _ = jobs.status_of(st.redis, job_id)
    except jobs.JobNotFound:
        return True
    return status in events.TERMINAL
