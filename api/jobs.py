"""Jobs in Redis: submit, look up, cancel. Used by the API routes and the cron scheduler;
the queue names and the item layout are in jobs.spec, the shards in jobs.shards.

Queues by model and priority (jobs.spec.queues): a job runs on the model it names, resolved
when it is submitted (jobs/models.py), and its model's workers take from its `high` queue
first, then `normal`, then `low`. A job's shards are rq jobs that call `worker.consumer.fanout_job` with the job
id and the shard number; the Fanout worker runs them in its engine (rq's fork-per-job path
is not used). A job's status is its own (the info hash's `state`, and the terminal status
once closed), not any rq job's.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from fastapi.exceptions import RequestValidationError
from redis.exceptions import WatchError
from rq import Queue
from rq.serializers import JSONSerializer

from results import blobs, events, keys, progress, publisher
from results import listing as results_listing

from jobs import items, shards
from jobs import models as fleet
from jobs.settings import Settings
from jobs.spec import JobSpec, queue_name
from worker.embedder.params import EmbedParams

from .lease import Lost
from .schemas import JobRequest
from .tenants import OverLimit, Tenant

class JobNotFound(KeyError):
    pass


def queue(redis, model: str, priority: str = "normal") -> Queue:
    return Queue(queue_name(model, priority), connection=redis, serializer=JSONSerializer)


def new_id() -> str:
    return uuid.uuid4().hex


class Claimed(Exception):
    """The idempotency key was claimed before: `stored` is its claim (id, hash, seed, items)."""

    def __init__(self, stored: dict):
        super().__init__(stored["id"])
        self.stored = stored


def check_limits(req: JobRequest, spec: JobSpec, settings) -> None:
    """The limits that depend on configuration; 422 naming the field, like pydantic's."""
    errors = []
    if req.size > settings.max_batch:
        errors.append({"loc": ("body", req.kind), "type": "too_long",
                       "msg": f"{req.size} items, over the limit of {settings.max_batch} (FANOUT_MAX_BATCH)"})
    per_item = isinstance(req.sampling_params, list)
    for i, p in enumerate(spec.sampling_params if per_item else spec.sampling_params[:1]):
        loc = ("body", "sampling_params") + ((i,) if per_item else ())
        if p.max_new_tokens > settings.max_new_tokens:
            errors.append({"loc": loc + ("max_new_tokens",), "type": "less_than_equal",
                           "msg": f"{p.max_new_tokens} is over the limit of {settings.max_new_tokens} "
                                  "(FANOUT_MAX_NEW_TOKENS)"})
        if p.n > settings.max_n:
            errors.append({"loc": loc + ("n",), "type": "less_than_equal",
                           "msg": f"{p.n} is over the limit of {settings.max_n} (FANOUT_MAX_N)"})
        if len(errors) >= 10:
            break
    if errors:
        raise RequestValidationError(errors)


def check_claim(redis, idempotency: tuple[str, str] | None, tenant: Tenant | None) -> None:
    """Claimed if the idempotency key was claimed already: a look before costly work (the
    submit's transaction checks again)."""
    if idempotency is not None:
        stored = redis.get(keys.idempotency(idempotency[0], tenant.id if tenant else None))
        if stored is not None:
            raise Claimed(json.loads(stored))


@dataclass(slots=True)
class Planned:
    """A job ready to be created: what its keys and shards need, its items laid out by
    shard (in lay.chunks, or in the blob store already when lay.chunks is None)."""
    kind: str
    ns: progress.Ns  # samples per item
    tokens: int  # the most it may generate: the sum of n * max_new_tokens
    seed: int
    custom_ids: list[str | None] | None
    lay: items.Layout
    task: str = "generate"  # jobs.spec.TASKS: what kind of worker runs it
    embed: EmbedParams | None = None  # an embedding job's parameters
    model: str = ""  # the served name it runs on (a LoRA adapter's, or a base model's)
    base: str = ""  # the model whose queues its shards go to (a LoRA adapter's base; "": looked up)

    @classmethod
    def of(cls, spec: JobSpec, settings: Settings, model: fleet.Model) -> "Planned":
        return cls(spec.kind, progress.Ns.of(p.n for p in spec.sampling_params),
                   sum(p.n * p.max_new_tokens for p in spec.sampling_params), spec.seed, spec.custom_ids,
                   items.layout(spec, settings), spec.task, spec.embed, model.name, model.base)


def model_of(redis, req: JobRequest) -> fleet.Model:
    """The model a request's job runs on: the one it names, or the fleet's one model of its
    task. Raises jobs.models.ModelError (unknown, another task's, or none named among several)."""
    return fleet.resolve(redis, req.model, req.task)


def submit(redis, req: JobRequest, settings: Settings, job_id: str | None = None,
           spec: JobSpec | None = None, idempotency: tuple[str, str] | None = None,
           tenant: Tenant | None = None, store: blobs.Store | None = None, online: bool = False) -> dict[str, Any]:
    """create() for a request: `spec` is req.spec() unless given; its model resolved
    (model_of). With a blob `store`, items over FANOUT_ITEMS_STORE_BYTES go there first
    (StoreError if it cannot take them)."""
    return create(redis, Planned.of(spec or req.spec(), settings, model_of(redis, req)), settings, req.priority,
                  req.run_at, req.metadata, job_id, idempotency, tenant, store, webhook=req.webhook_url,
                  online=online)


class Closed(Exception):
    """A validating job that was canceled (or failed) meanwhile: it is not created."""


def create(redis, planned: Planned, settings: Settings, priority: str = "normal", run_at: datetime | None = None,
           metadata: dict | None = None, job_id: str | None = None, idempotency: tuple[str, str] | None = None,
           tenant: Tenant | None = None, store: blobs.Store | None = None, validated=None,
           webhook: str | None = None, online: bool = False) -> dict[str, Any]:
    """Write the job's info hash and first stream entry, then hand it to rq, in one
    transaction. `idempotency` = (key, body hash): the key is claimed in that same
    transaction, so a claim never exists without its job; raises Claimed if the key was
    taken. `tenant` (None in open mode) owns the job: its rights and limits are checked
    (HTTPException 403, OverLimit) and the job takes one of its in-flight slots, given back
    by publisher.close. A job whose items are in the store already and is not created has
    them swept at once. `validated`: the lease of a dataset job's validation
    (api/validation.py): the job exists, `validating`, and is filled in here, while that
    lease is held (lease.Lost if not) and the job was not canceled (Closed); it took its
    in-flight slot when its validation started. `webhook`: the URL its end is POSTed to
    (api/webhooks.py; checked by the caller). `online`: an online request's job (api/online.py),
    whose answer the HTTP request delivers: it is not listed (GET /v1/jobs) and its keys go
    FANOUT_ONLINE_TTL after its end, not FANOUT_RESULT_TTL. Returns the JobCreated body."""
    if not planned.model:
        raise ValueError("a job runs on a model: Planned.model is empty")
    job_id = job_id or new_id()
    lay, ns, size = planned.lay, planned.ns, len(planned.ns)
    in_store = lay.chunks is None or (store is not None and lay.size > settings.items_store_bytes)
    due = {keys.due_job(job_id, 0, lay.total): 0}
    try:
        if tenant is not None:
            tenant.check_job(priority, size, planned.tokens)
        if run_at and run_at.microsecond:
            # rq schedules in whole seconds (rounding down): round up so a job never starts early.
            run_at = run_at.replace(microsecond=0) + timedelta(seconds=1)
        status = "scheduled" if run_at else "queued"
        wait = max(0, int((run_at - datetime.now(timezone.utc)).total_seconds())) if run_at else 0
        base = planned.base or _base(redis, planned.model)
        q = queue(redis, base, priority)
        info = {"total": size, "samples": ns.samples, "ns": ns.encode(), "seed": planned.seed,
                "priority": priority, "metadata": json.dumps(metadata or {}), "state": status,
                "created_at": progress.timestamp(), "task": planned.task, "model": planned.model, "base": base}
        if planned.embed is not None:
            info["embed"] = planned.embed.model_dump_json(exclude_none=True)
        if run_at:
            info["run_at"] = run_at.isoformat()
        if webhook:
            info["webhook"] = webhook
        if online:
            info["ttl"] = settings.online_ttl  # read by the close (results/publisher.py)
        lasts = wait + settings.job_timeout + (settings.online_ttl if online else settings.result_ttl)  # at most
        slots = keys.inflight(tenant.id) if tenant and validated is None else None
        claim = keys.idempotency(idempotency[0], tenant.id if tenant else None) if idempotency else None
        if in_store:
            if lay.chunks is not None:
                check_claim(redis, idempotency, tenant)  # before writing what that job already has
            # Due once the job has expired (api/sweep.py), or at once if it is not created (below);
            # due before they are written, so a process that dies meanwhile leaves nothing behind.
            redis.zadd(keys.blobs_due(), {m: time.time() + lasts for m in due})
            if lay.chunks is not None:
                items.store_items(store, job_id, lay)
        listed = None if online else keys.jobs(tenant.id if tenant else None)
        if listed:
            info["listed"] = listed  # the status scripts move it between its listing's indexes
        if slots:
            info.update(tenant=tenant.id, slot=slots)
        with redis.pipeline() as pipe:
            while True:
                if claim:
                    pipe.watch(claim)  # a request claiming the key meanwhile aborts this transaction
                    stored = pipe.get(claim)
                    if stored is not None:
                        pipe.reset()
                        raise Claimed(json.loads(stored))
                if validated is not None:
                    pipe.watch(keys.closed(job_id), validated.key)
                    if pipe.exists(keys.closed(job_id)):
                        pipe.reset()
                        raise Closed(job_id)
                    if not validated.held(pipe):
                        pipe.reset()
                        raise Lost(job_id)
                if slots:
                    watch_slot(pipe, tenant)
                pipe.multi()  # rq's enqueue_job expects the transaction opened explicitly
                info.update(shards.create(pipe, q, job_id, planned.kind, lay, settings, run_at, in_store))
                if slots:
                    pipe.incr(slots)
                if claim:
                    pipe.set(claim, json.dumps({"id": job_id, "hash": idempotency[1], "seed": planned.seed,
                                                "items": size}), ex=settings.result_ttl)
                if validated is not None:  # listed already, as validating: moved to its status's index
                    results_listing.set_state(pipe, job_id, status)
                pipe.hset(keys.info(job_id), mapping=info)
                pipe.xadd(keys.stream(job_id), events.status(status, total=size))
                if planned.custom_ids:
                    pipe.rpush(keys.custom_ids(job_id), *[c or "" for c in planned.custom_ids])
                # Kept until the job ends (then result_ttl); the margin covers a job that waits and runs.
                for k in (keys.info(job_id), keys.stream(job_id), keys.custom_ids(job_id), keys.items(job_id),
                          keys.shards(job_id)):
                    pipe.expire(k, lasts)
                # The listing: entries of expired jobs go when a listing meets them, or at this age.
                now = time.time()
                if validated is None and listed:
                    results_listing.add(pipe, listed, job_id, status, now,
                                        now - settings.job_timeout - settings.result_ttl)
                try:
                    pipe.execute()
                    break
                except WatchError:  # claimed (or a slot taken) by another request first: look again
                    continue
    except BaseException:
        if in_store:  # no job holds them: the sweep deletes them at once (api/sweep.py)
            redis.zadd(keys.blobs_due(), due)
        raise
    return {"id": job_id, "status": status, "stream": keys.stream(job_id), "seed": planned.seed,
            "items": size}


def watch_slot(pipe, tenant: Tenant) -> None:
    """Before a submit's MULTI: WATCH the tenant's in-flight count (another of its submits,
    or a job ending, meanwhile: the transaction is tried again), OverLimit if it is at its
    jobs_in_flight limit. The transaction then INCRs keys.inflight, and the job's info
    hash names it as its `slot` (given back by publisher.close)."""
    max_jobs = tenant.limits.get("jobs_in_flight")
    if max_jobs is None:
        return
    pipe.watch(keys.inflight(tenant.id))
    if int(pipe.get(keys.inflight(tenant.id)) or 0) >= max_jobs:
        pipe.reset()
        raise OverLimit("jobs_in_flight", f"{max_jobs} jobs validating, queued, scheduled or running: this "
                                          "API key's limit (jobs_in_flight)")


def _text(v) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


def status_of(redis, job_id: str) -> tuple[str, dict[str, str | None]]:
    """(status, timestamps: created_at, started_at, ended_at). The terminal status once the
    job is closed, else its state (queued, scheduled, running). Raises JobNotFound."""
    fields = ("state", "created_at", "started_at", "ended_at")
    with redis.pipeline(transaction=False) as pipe:
        pipe.get(keys.closed(job_id))
        pipe.hmget(keys.info(job_id), fields)
        closed, raw = pipe.execute()
    info = dict(zip(fields, map(_text, raw)))
    if closed:
        return _text(closed), info
    if info["state"] is None:
        raise JobNotFound(job_id)
    return info["state"], info


def owned(redis, job_id: str, tenant: Tenant | None) -> None:
    """Raises JobNotFound unless `tenant` may see the job: in open mode (None) every job;
    with keys only its own, so another tenant's job answers exactly as an unknown id. Every
    job route calls it."""
    if tenant is not None and _text(redis.hget(keys.info(job_id), "tenant")) != tenant.id:
        raise JobNotFound(job_id)


def describe(redis, job_id: str) -> dict[str, Any]:
    """The JobInfo body. Raises JobNotFound."""
    status, times = status_of(redis, job_id)
    info = progress.read(redis, job_id)
    if info is None:
        raise JobNotFound(job_id)
    error = info["error"]
    if status == "failed" and not error:
        error = "failed"
    if status == "succeeded":
        error = None  # an attempt's error that a retry got past
    return {
        "id": job_id, "status": status, "priority": info["priority"], "task": info["task"],
        "progress": {k: info[k] for k in ("total", "done", "failed", "samples", "samples_done")},
        "usage": {k: info[k] for k in ("prompt_tokens", "cached_tokens", "completion_tokens")},
        "error": error, "errors": info["errors"], "seed": info["seed"], "attempt": info["attempt"], "metadata": info["metadata"],
        "model": info["model"], "waiting": waiting(redis, info["model"]) if status == "queued" else None,
        "stream": keys.stream(job_id), "run_at": info["run_at"],
        "created_at": times["created_at"], "started_at": times["started_at"], "ended_at": times["ended_at"],
        "batching": {"steps": info["steps"], "max_batch_jobs": info["max_batch_jobs"]},
        "shards": shard_counts(redis, job_id, status),
        "webhook": webhook(redis, job_id),
    }


def webhook(redis, job_id: str) -> dict | None:
    """A job's webhook (JobInfo.webhook): its URL and how its delivery went (api/webhooks.py)."""
    url, state, attempts, error = map(_text, redis.hmget(keys.info(job_id), "webhook", "webhook_status",
                                                         "webhook_attempts", "webhook_error"))
    if url is None:
        return None
    return {"url": url, "status": state or "pending", "attempts": int(attempts or 0), "error": error or None}


def _base(redis, model: str) -> str:
    """The model whose queues a job for `model` goes to: a LoRA adapter's base, else itself."""
    m = fleet.get(redis, model)
    return model if m is None else m.base


def waiting(redis, model: str | None) -> str | None:
    """Why a queued job does not run yet, when it is for want of a worker serving its model."""
    return None if model is None else fleet.waiting(fleet.get(redis, model), model)


def shard_counts(redis, job_id: str, status: str) -> dict[str, Any]:
    """How many of the job's shards are queued, running, ended, and the workers running them."""
    c, on = shards.snapshot(redis, job_id)
    on = on if status not in events.TERMINAL else {}
    total, released, ended = c.get("total", 0), c.get("released", 0), c.get("ended", 0)
    return {"total": total, "queued": max(0, released - ended - len(on)), "running": len(on),
            "done": ended, "pending": total - released, "workers": sorted({events.worker_ref(w) for w in on.values()})}


def listing(redis, tenant: Tenant | None, after: str | None, limit: int,
            status: str | None = None) -> tuple[list[dict[str, Any]], bool]:
    """(JobInfo bodies newest first, after the job `after` and of `status` if given, at most
    `limit`; whether there are more). The tenant's jobs only (all in open mode); with a
    status, from its index (results/listing.py): the work is the page's, whatever the
    number of jobs. Raises JobNotFound if `after` is not listed."""
    listed = keys.jobs(tenant.id if tenant else None)
    key = listed if status is None else keys.by_status(listed, status)
    cursor = None
    if after is not None:
        score = redis.zscore(listed, after)
        if score is None:
            raise JobNotFound(after)
        cursor = (score, after)
    found, gone = [], []
    while len(found) <= limit:
        rows = results_listing.page(redis, key, cursor, limit + 1 - len(found))
        if not rows:
            break
        cursor = rows[-1][1], rows[-1][0]
        for job_id, _ in rows:
            try:
                info = describe(redis, job_id)
            except JobNotFound:
                gone.append(job_id)  # expired
                continue
            # The index moved with the status; one that changed since this page was read
            # is left to the listing of its new status.
            if status is None or info["status"] == status:
                found.append(info)
    if gone:
        redis.zrem(listed, *gone)
        for s in results_listing.STATUSES:
            redis.zrem(keys.by_status(listed, s), *gone)
    return found[:limit], len(found) > limit


_FLAG = "if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('SET', KEYS[2], 1, 'EX', ARGV[1]) end"


def cancel(redis, job_id: str, settings: Settings) -> str:
    """Request a cancel; returns the status after it. A job none of whose shards runs is
    canceled here (a worker claims a shard only while the flag is absent, in one
    transaction, so none can start after this looked); a running one by its workers,
    each within one engine step (they read the flag with each send, and this wakes them:
    keys.wake)."""
    status, _ = status_of(redis, job_id)
    if status in events.TERMINAL:
        return status
    # Only while the job is not closed (atomically: a worker may close it meanwhile): a flag set
    # after the close would outlive the job's other keys, which the close gave their TTL.
    redis.eval(_FLAG, 2, keys.closed(job_id), keys.cancel(job_id), settings.job_timeout + settings.result_ttl)
    if redis.hlen(keys.running(job_id)):
        fields = ("model", "base", "priority")
        info = dict(zip(fields, map(_text, redis.hmget(keys.info(job_id), fields))))
        # Its workers act now, not at their next send (a full engine carries its writes).
        redis.publish(keys.wake(shards.queue_of(info)), job_id)
        return "running"
    publisher.close(redis, job_id, "canceled", settings.result_ttl,
                    **shards.totals(redis, job_id))
    shards.drop_queued(redis, job_id)
    status, _ = status_of(redis, job_id)
    return status
