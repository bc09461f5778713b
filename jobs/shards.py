"""A job's shards in Redis: how a job is cut, queued, claimed and ended, by the API
(`create`), the workers (`claim`, `settle`) and the reapers (`settle`).

At submit the job is cut into shards of about FANOUT_SHARD_SAMPLES samples
(jobs.spec.plan) and its items go to its item list, one element per shard (the JSON
array of its items' entries), or, past FANOUT_ITEMS_STORE_BYTES, to the blob store, one
object per shard (jobs/items.py). A shard travels as an rq job `<job id>-<k>` whose arguments
name the job and k; its worker reads element k, or object k. A job keeps at most `window`
shards queued: the first ones are enqueued at
submit and every claim releases the next, so a job of a million items holds a window of
the queue, and jobs of one priority take turns (a job submitted behind a huge one waits
for `window` of its shards to be taken, not for all of them).

    queued --claim--> running --settle--> done      (the last one closes the job `succeeded`)
                                     \\--> canceled  (the job's cancel flag: closes it `canceled`)
                                     \\--> failed    (closes the job `failed`; its other shards stop)
                                     \\--> queued    (handed back, or retried after a failed attempt)
                                     \\--> scheduled (held: queued again settings.shard_hold seconds later)

State: keys.shards holds total, window, retries, released, ended, failed (1 once a shard
failed the job), and per shard
`claims:<k>` (attempts started) and `strikes:<k>` (attempts that failed having stored
nothing); keys.running maps each running shard to the attempt that holds it.

Invariants, true after every transaction: released = queued + running + ended (queued:
in rq's queues) and released <= total; a shard is in keys.running exactly while its
attempt's rq execution is registered (both change in the same transactions); a shard
struck more than `retries` times fails its job (a poison job ends, a job whose attempts
keep storing samples never does); the terminal status is written once
(results.publisher.close), by whoever ends the last shard, or the last running one of a
job that was canceled or failed: nothing writes to its stream after it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Callable

from redis.exceptions import WatchError
from rq import Queue
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.utils import as_text

from results import events, keys, listing, progress, publisher, store

from .items import Layout
from .settings import Settings
from .spec import JOB_FUNC, queue_name
from .unavailable import REDIS_DOWN

RPUSH_CHUNK = 10_000  # shards' item arrays per RPUSH

# Claim bookkeeping on the job's info hash, in the claim's transaction: the job's attempt
# count (1 + the retries of its shards), its start time, and `running` on the stream when
# it was not running (and its status index: results/listing.py). KEYS: info, stream. ARGV:
# this claim's number for its shard, now, the job id.
_STARTED = listing.SET_STATE + """
local old = redis.call('HGET', KEYS[1], 'state')
local n = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '0')
if tonumber(ARGV[1]) > 1 then n = n + 1 elseif n < 1 then n = 1 end
redis.call('HSET', KEYS[1], 'attempt', n)
set_state(KEYS[1], ARGV[3], 'running')
redis.call('HSETNX', KEYS[1], 'started_at', ARGV[2])
if old ~= 'running' then redis.call('XADD', KEYS[2], '*', 'type', 'status', 'status', 'running') end
return n
"""


# Taking a shard off its queue records it in keys.taking in the same script; the claim's
# transaction removes the record. KEYS: the queues (in priority order), keys.taking. ARGV:
# now. Returns {queue key, shard id} or false.
_TAKE = """
for i = 1, #KEYS - 1 do
  local id = redis.call('LPOP', KEYS[i])
  if id then
    redis.call('HSET', KEYS[#KEYS], id, ARGV[1] .. ' ' .. KEYS[i])
    return {KEYS[i], id}
  end
end
return false
"""
# The same for one id anywhere in one queue. KEYS: queue, keys.taking. ARGV: id, now.
_TAKE_ID = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. ' ' .. KEYS[1])
return 1
"""
# A record older than its worker could have taken to claim: queue the shard again (at the
# front) if it is still unclaimed. KEYS: keys.taking, the shard's rq job key. ARGV: id, record.
_PUT_BACK = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
if redis.call('HGET', KEYS[2], 'status') ~= 'queued' then return 0 end
local queue = string.sub(ARGV[2], string.find(ARGV[2], ' ') + 1)
redis.call('LPUSH', queue, ARGV[1])
return 1
"""


def take(redis, queues: list[Queue], now: float) -> tuple[Queue, str] | None:
    """The first queued shard id of these queues (in order), recorded as being taken."""
    got = redis.eval(_TAKE, len(queues) + 1, *[q.key for q in queues], keys.taking(), now)
    if not got:
        return None
    key, sid = as_text(got[0]), as_text(got[1])
    return next(q for q in queues if q.key == key), sid


def take_id(redis, queue: Queue, sid: str, now: float) -> bool:
    """Take that shard id out of its queue (anywhere in it), recorded as being taken."""
    return bool(redis.eval(_TAKE_ID, 2, queue.key, keys.taking(), sid, now))


def mark_taken(redis, queue: Queue, sid: str, now: float) -> None:
    """Record a shard popped by other means (rq's blocking pop) as being taken: the record
    the scripts above write."""
    redis.hset(keys.taking(), sid, f"{now} {queue.key}")


def untake(redis, sid: str) -> None:
    """Drop a take record whose shard will not be claimed (its rq job is gone)."""
    redis.hdel(keys.taking(), sid)


def put_back_stale(redis, older_than: float) -> list[str]:
    """Queue again the shards taken before `older_than` and never claimed (their worker
    died in between). Returns their ids."""
    back = []
    for sid, record in redis.hgetall(keys.taking()).items():
        sid, record = as_text(sid), as_text(record)
        if float(record.partition(" ")[0]) < older_than and redis.eval(
                _PUT_BACK, 2, keys.taking(), Job.key_for(sid), sid, record):
            back.append(sid)
    return back


def shard_id(job_id: str, k: int) -> str:
    return f"{job_id}-{k}"


def job_of(shard: str) -> str:
    """The job of a shard id (shard_id's inverse)."""
    return shard.rpartition("-")[0]


def _text(v) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


def _rq_job(q: Queue, job_id: str, k: int, timeout: int, scheduled: bool = False) -> Job:
    # result_ttl=0: rq forgets a shard once it ends; the job's own keys keep the outcome.
    return q.create_job(JOB_FUNC, kwargs={"job": job_id, "shard": k}, job_id=shard_id(job_id, k),
                        timeout=timeout, result_ttl=0, description=f"fanout job {job_id}, shard {k}",
                        status=JobStatus.SCHEDULED if scheduled else JobStatus.QUEUED)


def create(pipe, q: Queue, job_id: str, kind: str, lay: Layout, settings: Settings,
           run_at: datetime | None = None, in_store: bool = False) -> dict[str, str]:
    """In the submit's transaction (MULTI opened): the item list (unless the items are in
    the blob store, `in_store`), the shard counters and the first window of shards
    (scheduled for run_at if given). Returns the fields the job's info hash takes for its
    shards."""
    total = lay.total
    first = min(total, settings.shard_window)
    if not in_store:
        for i in range(0, total, RPUSH_CHUNK):
            pipe.rpush(keys.items(job_id), *lay.chunks[i:i + RPUSH_CHUNK])
    pipe.hset(keys.shards(job_id), mapping={"total": total, "window": settings.shard_window,
                                            "retries": settings.job_retries, "released": first,
                                            "ended": 0})
    for k in range(first):
        job = _rq_job(q, job_id, k, settings.job_timeout, scheduled=run_at is not None)
        if run_at is not None:
            q.schedule_job(job, run_at, pipeline=pipe)
        else:
            q.enqueue_job(job, pipeline=pipe)
    if run_at is None:
        pipe.publish(keys.wake(q.name), job_id)  # workers with full engines look now
    fields = {"kind": kind, "bounds": lay.bounds.encode(), "shards": total}
    if in_store:
        fields["items_in"] = "store"
    if lay.shared is not None:
        fields["params"] = lay.shared
    return fields


@dataclass(slots=True)
class Claim:
    """A shard this worker holds: its items [lo, hi) and what an earlier attempt stored."""
    job_id: str
    k: int
    lo: int
    hi: int
    job: Job  # the shard's rq job
    queue: Queue
    execution: Execution
    attempt: int  # the shard's claims so far, this one included
    stored: set[tuple[int, int]]  # (index, sample) stored before this attempt
    info: dict  # the job's info hash (decoded)


def _info(redis, job_id: str) -> dict | None:
    raw = redis.hgetall(keys.info(job_id))
    return {_text(k): _text(v) for k, v in raw.items()} if raw else None


def claim(redis, job: Job, queue: Queue, worker: str, ttl: int, on_pipe: Callable,
          on_outage: Callable) -> Claim | None:
    """Mark the shard started by `worker` in one transaction: rq's execution (heartbeat TTL
    `ttl`) and job status, keys.running, the claim count, the attempt entry on the stream,
    the next shard released to keep the window full; `on_pipe(pipe)` adds the worker's own
    writes. None if the shard is not queued any more, or its job ended or was canceled
    (the shard is dropped then). `on_outage(error)` waits for Redis; a transaction whose
    reply was lost is looked up, not sent again."""
    job_id, k = job.kwargs["job"], int(job.kwargs["shard"])
    taken = keys.taking()
    info = _info(redis, job_id)
    if info is None or "bounds" not in info:
        _forget(redis, job)
        untake(redis, job.id)
        return None
    bounds, ns = progress.Bounds.decode(info["bounds"]), progress.Ns.decode(info["ns"])
    lo, hi = bounds[k], bounds[k + 1]
    stored = store.stored(redis, job_id, ns, lo, hi)
    run, counters = keys.running(job_id), keys.shards(job_id)
    while True:
        execution = None
        try:
            with redis.pipeline() as pipe:
                pipe.watch(job.key, counters, run, keys.cancel(job_id), keys.closed(job_id))
                if as_text(pipe.hget(job.key, "status") or b"") != JobStatus.QUEUED:
                    pipe.reset()
                    untake(redis, job.id)
                    return None
                if pipe.exists(keys.cancel(job_id), keys.closed(job_id)):
                    pipe.multi()
                    pipe.delete(job.key)
                    pipe.hdel(taken, job.id)
                    pipe.execute()
                    return None
                c = _counters(pipe.hgetall(counters))
                running = pipe.hlen(run)
                attempt = c.get(f"claims:{k}", 0) + 1
                since = _now_id(pipe)  # its attempt entry and what follows are at or after this id
                pipe.multi()
                execution = Execution.create(job, ttl, pipeline=pipe, worker_name=worker)
                on_pipe(pipe)
                job.prepare_for_execution(worker, pipeline=pipe)
                pipe.persist(job.key)
                pipe.hdel(taken, job.id)
                pipe.hset(run, k, json.dumps({"worker": worker, "execution": execution.composite_key,
                                              "stored": len(stored), "since": since}))
                pipe.hincrby(counters, f"claims:{k}", 1)
                pipe.xadd(keys.stream(job_id), events.attempt(attempt, worker, k, lo, hi))
                pipe.eval(_STARTED, 2, keys.info(job_id), keys.stream(job_id), attempt, progress.timestamp(),
                          job_id)
                _release(redis, pipe, job_id, c, running + 1, queue_of(info), job.timeout)
                pipe.execute()
            break
        except WatchError:
            continue
        except REDIS_DOWN as e:
            on_outage(e)
            if execution is not None and holds(redis, job_id, k, execution.composite_key):
                break  # it applied; only the reply was lost
    return Claim(job_id, k, lo, hi, job, queue, execution, attempt, stored, info)


def _now_id(pipe) -> str:
    """The stream id of Redis's clock now: every entry added later has a greater id."""
    sec, usec = pipe.time()
    return f"{sec * 1000 + usec // 1000}-0"


def _trim(pipe, job_id: str, k: int) -> tuple[str, str] | None:
    """Under the settle's WATCH, for a done shard of a job whose results are kept in the
    blob store: the stream trimmed to the entries of the attempts still running (from the
    oldest one's start; from now if none is), since what the finished shards wrote is in
    their kept results. Returns (the MINID to trim to, the newest entry it drops), or None
    if it drops nothing. The info hash's `trimmed` takes that entry's id: a follower
    whose last id is older fell behind past it (api/submit.py tells it so)."""
    sinces = [json.loads(v).get("since") for kk, v in pipe.hgetall(keys.running(job_id)).items() if int(kk) != k]
    if None in sinces:  # claimed by an earlier version: nothing known of where it starts
        return None
    minid = min(sinces, key=events.pos) if sinces else _now_id(pipe)
    last = pipe.xrevrange(keys.stream(job_id), f"({minid}", "-", count=1)
    if not last:
        return None
    return minid, _text(last[0][0])


def _counters(raw: dict) -> dict[str, int]:
    return {_text(k): int(v) for k, v in raw.items()}


def queue_of(info: dict) -> str:
    """The queue of a job's shards, from its (decoded) info: its model's (a LoRA adapter's
    base's), at its priority."""
    return queue_name(info.get("base") or info["model"], info.get("priority") or "normal")


def _release(redis, pipe, job_id: str, c: dict[str, int], running: int, queue: str, timeout) -> None:
    """Enqueue the next shards, in `pipe` (MULTI opened), until the job has `window`
    queued; `c`: the counters as read under WATCH, `running`: keys.running's length after
    this transaction."""
    released = c["released"]
    queued = released - running - c["ended"]
    q = Queue(queue, connection=redis, serializer=JSONSerializer)
    while queued < c["window"] and released < c["total"]:
        q.enqueue_job(_rq_job(q, job_id, released, timeout), pipeline=pipe)
        released += 1
        queued += 1
    if released != c["released"]:
        pipe.hset(keys.shards(job_id), "released", released)


def holds(redis, job_id: str, k: int, execution: str) -> bool:
    """Whether that attempt still holds shard k."""
    raw = redis.hget(keys.running(job_id), k)
    return raw is not None and json.loads(raw)["execution"] == execution


def _forget(redis, job: Job) -> None:
    """A shard whose job is gone (expired): drop rq's copy."""
    redis.delete(job.key)


# Outcomes of settle.
DONE, CANCELED, FAILED, HANDED_BACK, RETRY, HELD = "done", "canceled", "failed", "handed back", "retry", "held"


def settle(redis, job_id: str, k: int, job: Job, execution: Execution, outcome: str, result_ttl: int,
           on_outage: Callable, error: str | None = None, progressed: bool = False,
           on_pipe: Callable | None = None, watch: tuple = (), still: Callable | None = None,
           trim: bool = False, hold: int | None = None) -> str | None:
    """End the attempt `execution` of shard k, in one transaction with its outcome:
    DONE, CANCELED, FAILED, HANDED_BACK (queued again at the front, no strike), HELD (the
    same `hold` seconds later: what it needs, e.g. the blob store, is away) or RETRY (queued
    again; a strike unless the attempt `progressed`, i.e. stored samples; FAILED once the
    shard has more strikes than the job's retries). Returns the outcome applied
    (RETRY may become FAILED), or None if that attempt no longer held the shard (settled
    meanwhile, e.g. by a reaper). A reaper also watches `watch` and settles only if
    `still(pipe)` holds under it (the execution is still expired). `trim`: DONE trims the
    job's stream (_trim; its results are kept in the blob store)."""
    run, counters = keys.running(job_id), keys.shards(job_id)
    composite = execution.composite_key
    while True:
        try:
            with redis.pipeline() as pipe:
                pipe.watch(run, counters, keys.closed(job_id), keys.cancel(job_id), *watch)
                raw = pipe.hget(run, k)
                if raw is None or json.loads(raw)["execution"] != composite:
                    return None
                if still is not None and not still(pipe):
                    return None
                c = _counters(pipe.hgetall(counters))
                running = pipe.hlen(run) - 1  # after this
                stopping = bool(pipe.exists(keys.cancel(job_id)))
                applied, why = outcome, error
                if outcome == RETRY:
                    strikes = c.get(f"strikes:{k}", 0) + (not progressed)
                    if strikes > c.get("retries", 0):
                        applied = FAILED
                        why = (f"{error}; shard {k} (items {_items(redis, job_id, k)}) failed {strikes} "
                               "attempts that stored nothing")
                if stopping and applied in (HANDED_BACK, RETRY, HELD):
                    applied = CANCELED  # canceled (or failed elsewhere) meanwhile: nothing to requeue
                closed = pipe.exists(keys.closed(job_id))
                counts = totals(redis, job_id)
                cut = _trim(pipe, job_id, k) if trim and applied == DONE else None
                pipe.multi()
                if cut is not None:
                    pipe.xtrim(keys.stream(job_id), minid=cut[0])
                    pipe.hset(keys.info(job_id), "trimmed", cut[1])
                pipe.hdel(run, k)
                execution.delete(job, pipeline=pipe)
                if on_pipe is not None:
                    on_pipe(pipe)
                batch = publisher.Batch(redis)
                if applied in (HANDED_BACK, RETRY, HELD):
                    if applied == RETRY and not progressed:
                        pipe.hincrby(counters, f"strikes:{k}", 1)
                    job.started_at = None
                    q = Queue(job.origin, connection=redis, serializer=JSONSerializer)
                    if applied == HELD:  # the workers' schedulers queue it again then (Member.schedule)
                        q.schedule_job(job, datetime.now(timezone.utc) + timedelta(seconds=hold), pipeline=pipe)
                    else:
                        q.enqueue_job(job, pipeline=pipe, at_front=True)
                    if why:
                        batch.info(job_id, error=why)
                    if running == 0 and not closed:
                        listing.set_state(pipe, job_id, "queued")
                        batch.status(job_id, "queued", error=why)
                else:
                    pipe.delete(job.key)
                    pipe.hincrby(counters, "ended", 1)
                    pipe.hdel(counters, f"claims:{k}", f"strikes:{k}")  # the hash holds the shards in flight
                    failed = c.get("failed", 0) or applied == FAILED
                    if applied == FAILED:
                        # The job fails with it: its other shards stop at their next step, and
                        # the last of them to stop writes the terminal entry.
                        pipe.set(keys.cancel(job_id), 1, ex=result_ttl)
                        pipe.hset(counters, "failed", 1)
                        batch.info(job_id, error=why)
                        stopping = True
                    if c["ended"] + 1 == c["total"] and not failed and not stopping:
                        batch.close(job_id, "succeeded", result_ttl, **counts)
                    elif (stopping or c["ended"] + 1 == c["total"]) and running == 0:
                        # The last running shard of a stopped job: after it nothing writes.
                        if failed:
                            message = why if applied == FAILED else _text(redis.hget(keys.info(job_id), "error"))
                            batch.close(job_id, "failed", result_ttl, error=message, **counts)
                        else:
                            batch.close(job_id, "canceled", result_ttl, **counts)
                batch.send(pipe)
            return applied
        except WatchError:
            continue
        except REDIS_DOWN as e:
            on_outage(e)
            if not holds(redis, job_id, k, composite):
                return outcome  # it applied; only the reply was lost


def _items(redis, job_id: str, k: int) -> str:
    bounds = progress.Bounds.decode(_text(redis.hget(keys.info(job_id), "bounds")))
    return f"{bounds[k]}-{bounds[k + 1] - 1}"


def totals(redis, job_id: str) -> dict:
    """The job's item counts, for its terminal status entry."""
    done, total, failed = redis.hmget(keys.info(job_id), "done", "total", "failed")
    return {"done": int(done or 0), "total": int(total or 0), "failed": int(failed or 0)}


def progressed(redis, job_id: str, k: int) -> bool:
    """Whether the attempt holding shard k stored samples (a reaper asks, about a dead one)."""
    raw = redis.hget(keys.running(job_id), k)
    info = _info(redis, job_id)
    if raw is None or info is None:
        return False
    bounds, ns = progress.Bounds.decode(info["bounds"]), progress.Ns.decode(info["ns"])
    return len(store.stored(redis, job_id, ns, bounds[k], bounds[k + 1])) > json.loads(raw)["stored"]


def drop_queued(redis, job_id: str) -> None:
    """Take a stopped job's queued and scheduled shards out of rq. Called once its cancel
    flag (or terminal status) is set, when no claim can succeed any more (claims watch
    both), so the running shards it skips are all there will be. A worker that dequeued
    one meanwhile finds it gone and skips it."""
    c, running = snapshot(redis, job_id)
    released = c.get("released", 0)
    model, base, priority = redis.hmget(keys.info(job_id), "model", "base", "priority")
    if model is None:  # never queued: a dataset job canceled while validating
        return
    q = Queue(queue_of({"model": _text(model), "base": _text(base), "priority": _text(priority)}),
              connection=redis, serializer=JSONSerializer)
    with redis.pipeline(transaction=False) as pipe:
        for k in range(released):
            if k not in running:
                sid = shard_id(job_id, k)
                pipe.lrem(q.key, 0, sid)
                pipe.zrem(q.scheduled_job_registry.key, sid)
                pipe.delete(Job.key_for(sid))
        pipe.execute()


SNAPSHOT_TRIES = 10


def snapshot(redis, job_id: str) -> tuple[dict[str, int], dict[int, str]]:
    """(the counters, running shard -> its worker) as of one moment: read apart, a shard
    settling between the two reads would count as queued. The counters are read before and
    after the running set, again until both reads agree: every transaction that changes the
    running set and the counts derived from it changes a counter too (claim, settle), none
    sets a counter back, and a shard handed back changes the running set alone, which either
    way reads as a state that was. Not MULTI: Redis at its maxmemory refuses every command
    queued in one, and reads must answer then. (After SNAPSHOT_TRIES reads that disagree,
    shards settling faster than a round trip, the last one as it is.)"""
    counters, run = keys.shards(job_id), keys.running(job_id)
    for _ in range(SNAPSHOT_TRIES):
        with redis.pipeline(transaction=False) as pipe:
            before, on, after = pipe.hgetall(counters).hgetall(run).hgetall(counters).execute()
        if before == after:
            break
    return _counters(after), {int(k): json.loads(v)["worker"] for k, v in on.items()}
