"""Jobs whose worker died: found and settled by any live worker, within seconds.

A job's execution in rq's StartedJobRegistry has a score = the time its heartbeat expires;
its worker pushes it forward every third of the TTL. rq looks for expired ones only in its
maintenance (every 10 minutes) and writes no stream entries, so every Fanout worker calls
`reap` every few seconds: each expired job is, in one transaction, canceled (a cancel was
asked: nobody watched its flag), retried (it resumes on a live worker from its stored
samples) or failed (no retries left), with its stream entry; a terminal one exactly once
(results.publisher.close guards it).
"""
from __future__ import annotations

from redis.exceptions import WatchError
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.job_lifecycle import record_job_failure
from rq.registry import CanceledJobRegistry
from rq.utils import as_text, current_timestamp, now, parse_composite_key, utcformat

from results import keys, progress
from results.publisher import Batch

from .logs import about


def counts(redis, job_id: str) -> dict:
    """The job's item counts, for its terminal status entry."""
    info = progress.read(redis, job_id) or {}
    return {k: info.get(k) for k in ("done", "total", "failed")}


def mark_canceled(job: Job, pipe, result_ttl: int) -> None:
    """The rq side of a cancel, in `pipe`."""
    job.set_status(JobStatus.CANCELED, pipeline=pipe)
    pipe.hset(job.key, "ended_at", utcformat(now()))
    CanceledJobRegistry(job.origin, job.connection, serializer=job.serializer).add(job, pipeline=pipe)
    job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)


def reap(redis, queues: list[Queue], serializer, result_ttl: int) -> list[tuple[str, str, str]]:
    """Settle every expired execution of these queues. Returns (job id, its dead worker,
    outcome) for each job settled here."""
    out = []
    for q in queues:
        registry = q.started_job_registry.key
        for entry in redis.zrangebyscore(registry, 0, current_timestamp()):
            settled = reap_one(redis, q, registry, as_text(entry), serializer, result_ttl)
            if settled:
                out.append(settled)
    return out


def reap_one(redis, queue: Queue, registry: str, entry: str, serializer,
             result_ttl: int) -> tuple[str, str, str] | None:
    job_id, _ = parse_composite_key(entry)
    with redis.pipeline() as pipe, about(job_id):
        try:
            # The owner's heartbeat writes the registry: watching it, a heartbeat (or
            # another reaper) that comes meanwhile voids this transaction.
            pipe.watch(registry)
            score = pipe.zscore(registry, entry)
            if score is None or score > current_timestamp():
                return None
            try:
                job = Job.fetch(job_id, connection=redis, serializer=serializer)
            except NoSuchJobError:
                job = None
            if job is None or job.get_status(refresh=False) != JobStatus.STARTED:
                pipe.multi()  # a leftover entry: only remove it
                pipe.zrem(registry, entry)
                pipe.execute()
                return None
            canceled = pipe.exists(keys.cancel(job_id))
            done = counts(redis, job_id)
            why = f"AbandonedJobError: its worker {job.worker_name} stopped sending heartbeats"
            batch = Batch(redis)
            pipe.multi()
            Execution.from_composite_key(entry, redis).delete(job=job, pipeline=pipe)
            if canceled:
                mark_canceled(job, pipe, result_ttl)
                batch.close(job_id, "canceled", result_ttl, **done)
                outcome = "canceled"
            elif job.retries_left:
                job.retry(queue, pipe)
                batch.info(job_id, error=why)
                batch.status(job_id, "queued", error=f"{why}; retrying")
                outcome = f"retried ({job.retries_left} retries left)"
            else:
                job.ended_at = now()
                record_job_failure(job, why, pipe)
                batch.info(job_id, error=why)
                batch.close(job_id, "failed", result_ttl, error=why, **done)
                outcome = "failed"
            batch.send(pipe)
        except WatchError:
            return None  # the next round looks again
    return job_id, job.worker_name, outcome
