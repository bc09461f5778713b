"""OpenAI batches. A batch is a native job underneath (same queue, workers, stream, retries
and resume): its id is `batch_` + the job's id, one item per input line with the line's
custom_id, so GET /v1/jobs/{job id}/events streams its lines' results as they are made.

Lifecycle: creation validates the input file against the batch (`validating`) and submits
the job (`in_progress`), or fails with `errors.data[]` naming the lines. Once the job has
ended, the output and error files are written (`finalizing`) and the batch is `completed`,
or `expired` (its window passed: the job was canceled; finished lines are in the output
file, the others in the error file as batch_expired), `cancelled` (POST .../cancel:
`cancelling` until the job has stopped; the same, as batch_cancelled) or `failed` (the job
failed). Every API process moves open batches along once a second, and any read does too."""
from __future__ import annotations

import json
import logging
import time

import anyio
import redis as redis_lib
from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import ValidationError
from redis.exceptions import WatchError

from results import blobs, keys, progress, store
from jobs import items
from jobs import models as fleet
from jobs.settings import Settings

from .. import jobs
from ..lease import Lease, Lost
from ..schemas import JobRequest
from ..tenants import OverLimit
from . import batchinput, bodies, embeddings, files, responses
from .errors import OpenAIErrorResponse, OpenAIError, from_validation, not_found
from .schemas import Batch, BatchCreate, BatchList

log = logging.getLogger("fanout.api")
router = APIRouter()

OPEN = ("validating", "in_progress", "finalizing", "cancelling")
STUCK = 600  # seconds: a batch still validating this long lost its API process meanwhile
LEASE = 10  # seconds a finalizing API process holds a batch between renewals
LOST = {"expired": ("batch_expired", "This request could not be executed before the completion window expired."),
        "cancelled": ("batch_cancelled", "This request was not executed: the batch was cancelled."),
        "failed": ("batch_failed", "This request was not executed: the batch failed.")}


def _job_id(batch_id: str) -> str:
    return batch_id.removeprefix("batch_")


def _tenant_id(tenant) -> str | None:
    return tenant.id if tenant else None


def load(redis, batch_id: str) -> dict | None:
    raw = redis.get(keys.batch(batch_id))
    return json.loads(raw) if raw else None


# A batch whose output files cannot be written yet shows why in its `errors`, while it stays
# `finalizing` (the store's own error goes to the API's log only: it names the store).
WAITING = {"object": "list", "data": [{
    "code": "store_unavailable", "line": None, "param": None,
    "message": "the output files wait for the blob store, which cannot be written now; tried again every second"}]}


def _update(redis, batch_id: str, change, ttl: int, lease: Lease | None = None) -> dict | None:
    """Apply `change(record)` -> the fields to set (None: leave it) atomically, and only
    while `lease` is held if one is given. An ended batch leaves the open set and expires
    `ttl` seconds later; its webhook, if it has one, is due in the same transaction."""
    key = keys.batch(batch_id)
    with redis.pipeline() as pipe:
        while True:
            try:
                pipe.watch(key, *([lease.key] if lease else []))
                raw = pipe.get(key)
                record = json.loads(raw) if raw else None
                fields = change(record) if record else None
                if lease is not None and not lease.held(pipe):
                    raise Lost(batch_id)
                if not fields:
                    pipe.reset()
                    return record
                was = record["status"]
                record.update(fields)
                pipe.multi()
                pipe.set(key, json.dumps(record))
                if record["status"] not in OPEN:
                    pipe.srem(keys.batches_open(), batch_id)
                    pipe.expire(key, ttl)
                    if was in OPEN and record.get("_webhook"):
                        pipe.zadd(keys.webhooks(), {f"batch:{batch_id}": 0})
                pipe.execute()
                return record
            except WatchError:
                continue


def public(redis, record: dict) -> dict:
    """The Batch object: the record without its internal fields; live counts while it runs."""
    obj = {k: v for k, v in record.items() if not k.startswith("_")}
    if record["status"] in ("in_progress", "cancelling"):
        info = progress.read(redis, _job_id(record["id"]))
        if info:
            obj["request_counts"] = {"total": info["total"], "completed": info["done"] - info["failed"],
                                     "failed": info["failed"]}
        if record["status"] == "in_progress" and (why := _waiting(redis, record)):
            obj["errors"] = {"object": "list", "data": [{"code": "model_not_served", "line": None,
                                                         "param": None, "message": why}]}
    return obj


def _waiting(redis, record: dict) -> str | None:
    """Why the batch's job waits queued: no live worker serves its model (None otherwise)."""
    try:
        status, _ = jobs.status_of(redis, _job_id(record["id"]))
    except jobs.JobNotFound:
        return None
    return jobs.waiting(redis, record.get("model")) if status == "queued" else None


def _owned(redis, batch_id: str, tenant) -> dict:
    record = load(redis, batch_id)
    if record is None or record["_tenant"] != _tenant_id(tenant):
        raise not_found("batch", batch_id)
    return record


@router.post("/batches", response_model=Batch)
def create(body: BatchCreate, request: Request):
    """Validate the input file against the batch and start its job: the batch comes back
    `in_progress`, or `failed` with the lines at fault in `errors.data`."""
    st, tenant = request.app.state, request.state.tenant
    redis, settings = st.redis, st.settings
    f = files.get(redis, body.input_file_id, tenant)
    if f["purpose"] != "batch":
        raise OpenAIError(400, f"file {f['id']} has purpose {f['purpose']!r}, not 'batch'", "input_file_id")
    job_id = jobs.new_id()
    batch_id, now = "batch_" + job_id, int(time.time())
    record = {"id": batch_id, "object": "batch", "endpoint": body.endpoint, "model": None, "errors": None,
              "input_file_id": f["id"], "completion_window": body.completion_window, "status": "validating",
              "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
              "expires_at": now + settings.batch_window, "finalizing_at": None, "completed_at": None,
              "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
              "request_counts": {"total": 0, "completed": 0, "failed": 0}, "usage": None,
              "metadata": body.metadata, "_tenant": _tenant_id(tenant),
              "_webhook": st.webhooks.target(body.webhook_url, tenant)}
    with redis.pipeline() as pipe:
        pipe.set(keys.batch(batch_id), json.dumps(record))
        pipe.zadd(keys.batches(_tenant_id(tenant)), {batch_id: time.time()})  # newest first, to the microsecond
        pipe.sadd(keys.batches_open(), batch_id)
        pipe.execute()

    def failed(errors: list[dict]) -> dict:
        return _update(redis, batch_id, lambda r: {"status": "failed", "failed_at": int(time.time()),
                                                   "errors": {"object": "list", "data": errors}}
                       if r["status"] == "validating" else None, settings.result_ttl)

    # The file is read as a stream and the job laid out by shard into the blob store as its
    # lines come: this process holds one shard's items, and per line its custom id and n.
    builder = items.Builder(redis, st.blobs, job_id, settings.shard_samples)
    try:
        try:
            # The job's own fields, checked as a native job's are (run_at after 1970).
            JobRequest(prompts=["-"], priority=body.priority, run_at=body.run_at, metadata=body.metadata or {})
            # Each known model -> its task and the image URL schemes its live workers take (None
            # with no live worker: the worker checks those lines).
            served = {name: (m.task, m.entry.get("images") if m.live else None)
                      for name, m in fleet.read(redis).items()}
            requests = batchinput.read(blobs.lines(files.content(redis, st.blobs, f["id"], tenant)), settings)
            planned, model, encoding = batchinput.plan(requests, body.endpoint, served, builder)
        except BaseException:
            builder.abandon()
            raise
        _update(redis, batch_id, lambda r: {"model": model, "_encoding": encoding, "request_counts": {
            "total": len(planned.ns), "completed": 0, "failed": 0}}, settings.result_ttl)
        jobs.create(redis, planned, settings, body.priority, body.run_at, body.metadata or {}, job_id,
                    tenant=tenant)
    except batchinput.Invalid as e:
        return public(redis, failed([x.data() for x in e.errors]))
    except ValidationError as e:  # the job's own checks (run_at before 1970)
        error = from_validation(e.errors())
        failed([{"code": "invalid_request", "line": None, "message": error.message, "param": error.param}])
        raise error from None
    except (HTTPException, OverLimit, OpenAIError) as e:  # the key's rights or limits; the file gone
        failed([{"code": "rejected", "line": None, "message": str(getattr(e, "detail", e)), "param": None}])
        raise
    except blobs.StoreError:  # the file's bytes unreadable now: a 503, and the batch says why
        failed([{"code": "store_unavailable", "line": None, "param": None,
                 "message": "the blob store could not be read or written; create the batch again"}])
        raise
    record = _update(redis, batch_id, lambda r: {"status": "in_progress", "in_progress_at": int(time.time())}
                     if r["status"] == "validating" else None, settings.result_ttl)
    if record["status"] != "in_progress":  # cancelled while validating: its job must not run
        jobs.cancel(redis, job_id, settings)
    return public(redis, advance(redis, settings, st.blobs, batch_id) or record)


@router.get("/batches/{batch_id}", response_model=Batch)
def retrieve(batch_id: str, request: Request):
    st = request.app.state
    _owned(st.redis, batch_id, request.state.tenant)
    return public(st.redis, advance(st.redis, st.settings, st.blobs, batch_id))


@router.get("/batches", response_model=BatchList)
def list_batches(request: Request, after: str | None = Query(None), limit: int = Query(20, ge=1, le=100)):
    """Your batches, newest first."""
    redis = request.app.state.redis
    key = keys.batches(_tenant_id(request.state.tenant))
    start = 0
    if after is not None:
        rank = redis.zrevrank(key, after)
        if rank is None:
            raise not_found("batch", after)
        start = rank + 1
    ids = [i.decode() for i in redis.zrange(key, start, start + limit, desc=True)]
    records = [json.loads(r) if r else None for r in redis.mget([keys.batch(i) for i in ids])] if ids else []
    gone = [i for i, r in zip(ids, records) if r is None]
    if gone:  # expired; the page may come out short, has_more still tells
        redis.zrem(key, *gone)
    data = [public(redis, r) for r in records[:limit] if r]
    return {"data": data, "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
            "has_more": len(ids) > limit}


@router.post("/batches/{batch_id}/cancel", response_model=Batch, responses={
    409: {"model": OpenAIErrorResponse, "description": "the batch has ended"}})
def cancel(batch_id: str, request: Request):
    """`cancelling` until the job has stopped, then `cancelled`; finished lines are kept."""
    st = request.app.state
    record = _owned(st.redis, batch_id, request.state.tenant)
    if record["status"] not in OPEN:
        raise OpenAIError(409, f"Cannot cancel a batch with status {record['status']}")
    _update(st.redis, batch_id, lambda r: {"status": "cancelling", "cancelling_at": int(time.time())}
            if r["status"] in ("validating", "in_progress") else None, st.settings.result_ttl)
    return public(st.redis, advance(st.redis, st.settings, st.blobs, batch_id))


# -- moving batches along ----------------------------------------------------------------

def advance(redis, settings: Settings, blob_store: blobs.Store, batch_id: str) -> dict | None:
    """One look at an open batch: expire or cancel its job when due, and once the job has
    ended write the output and error files (one API process at a time). Returns the record."""
    record = load(redis, batch_id)
    if record is None or record["status"] not in OPEN:
        return record
    job_id, now = _job_id(batch_id), time.time()
    try:
        status, _ = jobs.status_of(redis, job_id)
    except jobs.JobNotFound:
        status = None  # not submitted (yet), or expired
    if record["status"] == "validating":
        if now - record["created_at"] < STUCK:
            return record  # the creating request is still at it
        # Its API process stopped midway: before the job was submitted, or after.
        fields = {"status": "in_progress", "in_progress_at": int(now)} if status else {
            "status": "failed", "failed_at": int(now), "errors": {"object": "list", "data": [
                {"code": "interrupted", "line": None, "message": "validation was interrupted", "param": None}]}}
        return _update(redis, batch_id, lambda r: fields if r["status"] == "validating" else None,
                       settings.result_ttl)
    ended = status in ("succeeded", "failed", "canceled") or status is None
    if not ended and (record["status"] == "cancelling" or now >= record["expires_at"]):
        if record["status"] == "in_progress":
            record = _update(redis, batch_id, lambda r: None if r.get("_expiring") else {"_expiring": True},
                             settings.result_ttl)
        jobs.cancel(redis, job_id, settings)  # a running job stops within one engine step
        return record
    # Its files have ids made from the batch's: a second finalizer overwrites them, leaving no orphans.
    lease = Lease(redis, keys.batch_lock(batch_id), LEASE)
    if not ended or not lease.take():
        return record
    try:
        return _finalize(redis, settings, blob_store, batch_id, status, lease)
    except Lost:
        log.warning("batches: %s took over %d s between renewals of its lease; another process "
                    "finalizes it", batch_id, LEASE)
        return load(redis, batch_id)
    except blobs.Gone as e:  # lost for good: waiting cannot help, the batch fails naming it
        log.error("batches: %s cannot be finalized: %s", batch_id, e)
        lost = {"status": "failed", "failed_at": int(time.time()), "errors": {"object": "list", "data": [
            {"code": "results_lost", "line": None, "param": None, "message": f"{e}; create the batch again"}]}}
        return _update(redis, batch_id, lambda r: lost if r["status"] == "finalizing" else None, settings.result_ttl)
    except blobs.StoreError as e:  # its samples wait in Redis: the next sweep tries again, and says so
        log.warning("batches: %s cannot be finalized yet: %s", batch_id, e)
        return _update(redis, batch_id, lambda r: {"errors": WAITING} if r["status"] == "finalizing" else None,
                       settings.result_ttl)
    finally:
        lease.release()


def _ending(record: dict, job_status: str | None) -> str:
    if job_status == "succeeded":
        return "completed"
    if record.get("_expiring"):
        return "expired"
    if record["status"] == "cancelling" or job_status == "canceled":
        return "cancelled"
    return "failed"


def _finalize(redis, settings: Settings, blob_store: blobs.Store, batch_id: str, job_status: str | None,
              lease: Lease) -> dict:
    """Write the output and error files, then the final record, holding `lease` (renewed
    as the lines are built). A holder that died midway left the record `finalizing`: the
    next one starts again from the stored samples, which no longer change. A blob store
    that fails leaves it `finalizing` too, retried by the next sweep."""
    record = _update(redis, batch_id, lambda r: {"status": "finalizing", "finalizing_at": int(time.time()),
                                                 "_ending": _ending(r, job_status)}
                     if r["status"] in ("in_progress", "cancelling") else None, settings.result_ttl, lease)
    if record["status"] != "finalizing":
        return record  # another process finalized it meanwhile
    ending, job_id = record["_ending"], _job_id(batch_id)
    # Ids made from the batch's: a second finalizer replaces these files, leaving no orphans.
    ids = {"output": f"file-{job_id}-output", "error": f"file-{job_id}-error"}
    for file_id in ids.values():
        files.writing(redis, file_id)
    with blob_store.writer(keys.file_blob(ids["output"])) as output, blob_store.writer(keys.file_blob(ids["error"])) as errors:
        counts, usage = _lines(redis, blob_store, record, ending, lease, output, errors)
        if not counts["output"]:
            output.abort()
        if not counts["error"]:
            errors.abort()
    done = {"status": ending, f"{ending}_at": int(time.time()), "errors": None,  # no longer waiting
            # Every line is counted once: answered, or in the error file (failed, or not run
            # because the batch was cancelled or expired first).
            "request_counts": {"total": record["request_counts"]["total"], "completed": counts["output"],
                               "failed": counts["error"]},
            "usage": usage}
    for name, w in (("output", output), ("error", errors)):
        if counts[name]:
            if not lease.renew():
                raise Lost(batch_id)
            done[f"{name}_file_id"] = files.record(redis, blob_store, ids[name], w.size, f"{batch_id}_{name}.jsonl",
                                                   "batch_output", record["_tenant"], settings.result_ttl)["id"]
    if ending == "failed":
        info = progress.read(redis, job_id)
        done["errors"] = {"object": "list", "data": [{"code": "job_failed", "line": None, "param": None,
                                                      "message": (info or {}).get("error") or "the batch's job failed"}]}
    return _update(redis, batch_id, lambda r: done if r["status"] == "finalizing" else None, settings.result_ttl,
                   lease)


def _lines(redis, blob_store: blobs.Store, record: dict, ending: str, lease: Lease, output: blobs.Writer,
           errors: blobs.Writer) -> tuple[dict, dict]:
    """Write the output and error lines from the job's stored samples, a page at a time
    (the lease renewed at each); returns the count of each and the batch's usage (summed
    over the output)."""
    job_id = _job_id(record["id"])
    endpoint = record["endpoint"]
    info = progress.read(redis, job_id)
    ns, created = (info["ns"] if info else []), int(time.time())
    counts, prompt, cached, completion = {"output": 0, "error": 0}, 0, 0, 0

    def write(to, name: str, line: dict) -> None:
        to.write(json.dumps(line).encode() + b"\n")
        counts[name] += 1

    for offset in range(0, len(ns), 1000):
        if not lease.renew():
            raise Lost(record["id"])
        answered = []
        for item in store.page(redis, blob_store, job_id, info, offset, 1000):
            i, samples = item["index"], item["samples"]
            line = {"id": f"batch_req_{job_id}_{i}", "custom_id": item["custom_id"]}
            request_id = f"req_{job_id}_{i}"
            bad = next((s for s in samples if s["finish_reason"] == "error"), None)
            if bad is not None:
                body = OpenAIError(400, bad["error"] or "error", code="invalid_prompt").body()
                write(errors, "error", {**line, "response": {"status_code": 400, "request_id": request_id,
                                                             "body": body}, "error": None})
            elif len(samples) == ns[i]:
                body = _body(endpoint, job_id, i, created, record["model"], samples, record.get("_encoding"))
                write(output, "output", {**line, "response": {"status_code": 200, "request_id": request_id,
                                                              "body": body}, "error": None})
                answered.append(samples)
            else:
                code, message = LOST[ending if ending in LOST else "failed"]
                write(errors, "error", {**line, "response": None, "error": {"code": code, "message": message}})
        page = bodies.usage(answered)
        prompt += page["prompt_tokens"]
        cached += page["prompt_tokens_details"]["cached_tokens"]
        completion += page["completion_tokens"]
    return counts, {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                    "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": prompt + completion}


def _body(endpoint: str, job_id: str, i: int, created: int, model: str, samples: list[dict],
          encoding: str | None = None) -> dict:
    """Line i's answer as its endpoint's response body (`encoding`: an embedding batch's)."""
    if endpoint == "/v1/embeddings":
        return embeddings.body(model, samples, encoding or "float")
    if endpoint == "/v1/responses":
        return responses.batch_body(f"resp_{job_id}_{i}", created, model, samples[0])
    if endpoint == "/v1/chat/completions":
        return bodies.chat_completion(f"chatcmpl-{job_id}-{i}", created, model, [samples])
    return bodies.text_completion(f"cmpl-{job_id}-{i}", created, model, [samples])


async def sweep(state) -> None:
    """Every API process, once a second: move the open batches along."""
    while True:
        await anyio.sleep(1.0)
        try:
            await anyio.to_thread.run_sync(_sweep_once, state.redis, state.settings, state.blobs)
        except redis_lib.RedisError as e:
            log.warning("batches: redis unavailable (%s); trying again", e)


def _sweep_once(redis, settings: Settings, blob_store: blobs.Store) -> None:
    for batch_id in redis.smembers(keys.batches_open()):
        try:
            advance(redis, settings, blob_store, batch_id.decode())
        except redis_lib.RedisError:
            raise
        except Exception:  # noqa: BLE001 - one bad batch must not hold up the others
            log.exception("batches: %s could not be moved along", batch_id.decode())
