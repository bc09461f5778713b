"""A dataset job's validation, after its POST has answered (as OpenAI's batches do).

    POST /v1/jobs {input_file_id | input_url}
      -> the job, `validating`: its info hash (with the request), listing, first stream
         entry and idempotency claim, in one transaction; 202 with its id
      -> in the background, holding the job's lease: every line read, checked and laid out
         by shard into the blob store (api/dataset.py), then the job filled in and queued
         (jobs.create), or `failed`, its `error` and `errors` naming the lines at fault

The lease (keys.validation, FANOUT_VALIDATION_LEASE seconds) is renewed as the lines are
read; every couple of seconds, once the shards laid out so far are written, a checkpoint
(keys.checkpoint: the row to read next, the layout so far) is saved under the lease. A
process that died midway leaves the lease to expire, and the sweep of any API process
(api/sweep.py) resumes the validation from the checkpoint (or the first line): the rows
before it are skipped, the custom ids seen read back from their shards, the layout writes
the same objects, and the job keeps its id, seed and claim. A job canceled while validating is never queued.
"""
from __future__ import annotations

import json
import logging
import threading
import time

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from redis.exceptions import WatchError

from results import blobs, events, keys, listing, progress, publisher
from jobs import items
from jobs.settings import Settings

from . import dataset, jobs, tenants
from .batchfile import BatchFileError
from .lease import Lease, Lost
from .openai import files
from .openai.errors import OpenAIError
from .schemas import JobRequest
from .tenants import OverLimit

log = logging.getLogger("fanout.api")
RENEW_ROWS = 1000  # rows read between renewals


def start(redis, req: JobRequest, settings: Settings, tenant, idempotency) -> dict:
    """The job, `validating`, in one transaction with its idempotency claim (jobs.Claimed if
    that was taken) and its tenant's in-flight slot (OverLimit at its limit: a job
    validating counts as one in flight); returns the JobCreated body. The caller then runs
    `validate` with the lease this took."""
    job_id, seed, now = jobs.new_id(), dataset.job_seed(req), time.time()
    listed = keys.jobs(tenant.id if tenant else None)
    info = {"state": "validating", "total": 0, "samples": 0, "seed": seed, "priority": req.priority,
            "metadata": json.dumps(req.metadata or {}), "created_at": progress.timestamp(), "listed": listed,
            "model": req.model, "request": req.model_dump_json(exclude_none=True)}
    if req.webhook_url:  # a dataset that fails validation ends the job: its webhook is due then
        info["webhook"] = req.webhook_url
    if tenant:
        info.update(tenant=tenant.id, slot=keys.inflight(tenant.id))
    lasts = settings.job_timeout + settings.result_ttl
    claim = keys.idempotency(idempotency[0], tenant.id if tenant else None) if idempotency else None
    with redis.pipeline() as pipe:
        while True:
            try:
                if claim:
                    pipe.watch(claim)
                    stored = pipe.get(claim)
                    if stored is not None:
                        pipe.reset()
                        raise jobs.Claimed(json.loads(stored))
                if tenant:
                    jobs.watch_slot(pipe, tenant)
                pipe.multi()
                if tenant:
                    pipe.incr(keys.inflight(tenant.id))
                pipe.hset(keys.info(job_id), mapping=info)
                pipe.xadd(keys.stream(job_id), events.status("validating"))
                for k in (keys.info(job_id), keys.stream(job_id)):
                    pipe.expire(k, lasts)
                listing.add(pipe, listed, job_id, "validating", now, now - lasts)
                if claim:
                    pipe.set(claim, json.dumps({"id": job_id, "hash": idempotency[1], "seed": seed, "items": None}),
                             ex=settings.result_ttl)
                pipe.sadd(keys.validating(), job_id)
                pipe.execute()
                break
            except WatchError:
                continue
    return {"id": job_id, "status": "validating", "stream": keys.stream(job_id), "seed": seed, "items": None}


def validate(redis, store: blobs.Store, settings: Settings, job_id: str, lease: Lease) -> None:
    """Read, check and lay out the job's dataset, then queue the job, or fail it naming the
    lines at fault, holding `lease` (taken by the caller). Never raises: whatever goes
    wrong is the job's error."""
    raw = redis.hgetall(keys.info(job_id))
    info = {k.decode(): v.decode() for k, v in raw.items()}
    if info.get("state") != "validating" or redis.exists(keys.closed(job_id)):
        _done(redis, job_id, lease)  # canceled meanwhile, or expired
        return
    req = JobRequest.model_validate_json(info["request"])
    builder = items.Builder(redis, store, job_id, settings.shard_samples)
    try:
        tenant = tenants.by_id(redis, info["tenant"]) if "tenant" in info else None
        if req.input_file_id is not None:
            chunks = files.content(redis, store, req.input_file_id, tenant)
        else:
            chunks = dataset.open_url(req.input_url, settings, store, tenant)
        form, records = dataset.rows(chunks)
        redis.hset(keys.info(job_id), "input_format", form)  # its output's default format (GET /output)
        saved = redis.get(keys.checkpoint(job_id))
        resume = json.loads(saved) if saved else None
        if resume is not None:
            log.warning("job %s: resuming its validation at row %d (%d items laid out before)", job_id,
                        resume["row"], resume["count"])
        planned = dataset.plan(_renewing(records, lease, redis, job_id), req, settings, builder, int(info["seed"]),
                               _saver(redis, job_id, lease, settings), resume)
        jobs.create(redis, planned, settings, req.priority, req.run_at, req.metadata, job_id, tenant=tenant,
                    validated=lease)
        log.info("job %s: dataset validated, %d items queued", job_id, len(planned.ns))
    except Lost:
        log.warning("job %s: its validation lease ran out; another API process validates it", job_id)
        return  # not abandoned: the other process writes the same objects
    except jobs.Closed:
        builder.abandon()  # canceled while validating: never queued
    except RequestValidationError as e:
        builder.abandon()
        _fail(redis, job_id, settings, list(e.errors()))
    except Exception as e:  # noqa: BLE001 - the job says why; the process goes on
        builder.abandon()
        _fail(redis, job_id, settings, None, _message(e))
        if not isinstance(e, (blobs.StoreError, OverLimit, HTTPException, OpenAIError, BatchFileError)):
            log.exception("job %s: validation failed", job_id)
    _done(redis, job_id, lease)


def spawn(redis, store: blobs.Store, settings: Settings, job_id: str, lease: Lease) -> None:
    """validate() in a thread of this process (a daemon: a process that stops leaves the
    lease to expire, and another one's sweep starts the validation again)."""
    threading.Thread(target=validate, args=(redis, store, settings, job_id, lease), daemon=True,
                     name=f"validate-{job_id}").start()


def _saver(redis, job_id: str, lease: Lease, settings: Settings):
    """plan's checkpoint: written while this process holds the lease (Lost if not)."""
    def save(state: dict) -> None:
        with redis.pipeline() as pipe:
            try:
                pipe.watch(lease.key)
                if not lease.held(pipe):
                    raise Lost(lease.key)
                pipe.multi()
                pipe.set(keys.checkpoint(job_id), json.dumps(state), ex=settings.job_timeout + settings.result_ttl)
                pipe.execute()
            except WatchError:  # the lease changed hands meanwhile
                raise Lost(lease.key) from None
    return save


def _renewing(records, lease: Lease, redis, job_id: str):
    """The records, the lease renewed every RENEW_ROWS of them; a job canceled meanwhile
    stops the reading there."""
    for i, record in enumerate(records):
        if i % RENEW_ROWS == 0:
            if not lease.renew():
                raise Lost(lease.key)
            if redis.exists(keys.closed(job_id)):
                raise jobs.Closed(job_id)
        yield record


def _message(e: Exception) -> str:
    if isinstance(e, HTTPException):
        return str(e.detail)
    if isinstance(e, OpenAIError):
        return e.message
    return str(e) or type(e).__name__


def _fail(redis, job_id: str, settings: Settings, errors: list[dict] | None, message: str | None = None) -> None:
    if errors is not None:
        shown = "; ".join(f"line {e['loc'][2]}: {'.'.join(map(str, e['loc'][3:])) or 'line'}: {e['msg']}"
                          if len(e["loc"]) > 2 else f"{e['msg']}" for e in errors[:5])
        message = f"the dataset has errors ({len(errors)}{'+' if len(errors) >= dataset.MAX_ERRORS else ''}): {shown}"
        redis.hset(keys.info(job_id), "errors", json.dumps(errors))
    redis.hset(keys.info(job_id), "error", message)
    publisher.close(redis, job_id, "failed", settings.result_ttl, error=message, done=0, total=0, failed=0)


def _done(redis, job_id: str, lease: Lease) -> None:
    with redis.pipeline() as pipe:
        pipe.srem(keys.validating(), job_id)
        pipe.delete(keys.checkpoint(job_id))
        pipe.execute()
    lease.release()


def resume_stalled(redis, store: blobs.Store, settings: Settings) -> list[str]:
    """The sweep's part: validations whose process died (lease expired) start again here,
    each in a thread of its own. Returns their job ids."""
    resumed = []
    for raw in redis.smembers(keys.validating()):
        job_id = raw.decode()
        if not redis.exists(keys.info(job_id)):
            redis.srem(keys.validating(), job_id)  # expired
            continue
        lease = Lease(redis, keys.validation(job_id), settings.validation_lease)
        if lease.take():
            log.warning("job %s: its validation stopped midway (its API process went away); starting it again",
                        job_id)
            spawn(redis, store, settings, job_id, lease)
            resumed.append(job_id)
    return resumed
