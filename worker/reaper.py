"""Shards whose worker died: found and settled by any live worker, within seconds.

A shard attempt's execution in rq's StartedJobRegistry has a score = the time its
heartbeat expires; its worker pushes it forward every third of the TTL. rq would mark
expired ones failed in its maintenance (at a worker's start, then every 10 minutes), with no
stream entries and no retry; the Fanout worker leaves that to this module instead (its loop
reaps before rq's maintenance, whose Member.clean_registries skips the StartedJobRegistry)
and calls `reap` every few seconds (`Reaper`): each expired shard is settled
(jobs/shards.py) in one transaction: canceled (a cancel was asked: nobody watched its
flag), retried (it resumes on a live worker from its stored samples; a strike only if the
dead attempt stored nothing) or, struck more often than the job's retries, failed with
its job, with its stream entries; a terminal one exactly once.
"""
from __future__ import annotations

import logging
import time

from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.utils import as_text, current_timestamp

from jobs import models, shards
from jobs.logs import JobLog, about
from jobs.settings import Settings
from jobs.spec import queues as queue_names
from results import events, keys

from .member import Member
from .metrics import WorkerMetrics
from .outage import Link

log = logging.getLogger("fanout.worker")

REAP_INTERVAL = 2.0  # seconds between looks for expired executions: one ZRANGEBYSCORE per queue


def reap(redis, queues: list[Queue], serializer, result_ttl: int, on_outage) -> list[tuple[str, str, str]]:
    """Settle every expired execution of these queues. Returns (job id, its dead worker,
    outcome) for each shard settled here."""
    out = []
    for q in queues:
        registry = q.started_job_registry.key
        for entry in redis.zrangebyscore(registry, 0, current_timestamp()):
            settled = reap_one(redis, registry, as_text(entry), serializer, result_ttl, on_outage)
            if settled:
                out.append(settled)
    return out


def _leftover(redis, registry: str, execution: Execution, job: Job | None) -> None:
    """An entry no attempt holds (its shard was settled, or its job expired): remove it."""
    with redis.pipeline() as pipe:
        if job is not None:
            execution.delete(job, pipeline=pipe)
        pipe.zrem(registry, execution.composite_key)
        pipe.execute()


def reap_one(redis, registry: str, entry: str, serializer, result_ttl: int,
             on_outage) -> tuple[str, str, str] | None:
    execution = Execution.from_composite_key(entry, redis)
    try:
        job = Job.fetch(execution.job_id, connection=redis, serializer=serializer)
    except NoSuchJobError:
        job = None
    if job is None or job.get_status(refresh=False) != JobStatus.STARTED or "shard" not in job.kwargs:
        _leftover(redis, registry, execution, job)
        return None
    job_id, k = job.kwargs["job"], int(job.kwargs["shard"])
    worker = job.worker_name
    # A reader sees the worker's opaque id (events.worker_ref), never its name (host, PID).
    why = f"AbandonedJobError: its worker {events.worker_ref(worker)} stopped sending heartbeats"

    def expired(pipe) -> bool:
        # The owner's heartbeat writes the registry: one that came meanwhile voids this.
        score = pipe.zscore(registry, entry)
        return score is not None and score <= current_timestamp()

    with about(job_id):
        outcome = shards.RETRY
        if redis.exists(keys.cancel(job_id)):
            outcome = shards.CANCELED
        applied = shards.settle(redis, job_id, k, job, execution, outcome, result_ttl, on_outage,
                                error=why, progressed=shards.progressed(redis, job_id, k),
                                watch=(registry,), still=expired)
    if applied in (shards.CANCELED, shards.FAILED):
        shards.drop_queued(redis, job_id)
    if applied is None:
        if not shards.holds(redis, job_id, k, entry):  # settled before: a leftover entry
            _leftover(redis, registry, execution, job)
        return None
    return job_id, worker, {shards.RETRY: f"retried (shard {k})", shards.FAILED: f"failed (shard {k})",
                            shards.CANCELED: "canceled"}[applied]


class Reaper:
    """This worker's share of the fleet's reaping: every REAP_INTERVAL seconds (and before
    rq's registry maintenance), the expired executions of every known model's queues are
    settled, and the
    shards taken off a queue by a worker that died before its claim are queued again.
    Owns only its schedule."""

    def __init__(self, member: Member, link: Link, settings: Settings, metrics: WorkerMetrics):
        self.member = member
        self.link = link
        self.settings = settings
        self.metrics = metrics
        self._next = 0.0

    def due(self, t: float) -> bool:
        if t < self._next:
            return False
        self._next = t + REAP_INTERVAL
        return True

    def queues(self) -> list[Queue]:
        """Its own model's queues, and every other known model's: a model whose workers all
        died has its shards settled (queued again, waiting for a worker) by whoever is alive."""
        m = self.member
        own = {q.name for q in m.queues}
        others = sorted({q for model in models.read(m.connection).values() for q in queue_names(model.base)} - own)
        return m.queues + [Queue(name, connection=m.connection, serializer=m.serializer) for name in others]

    def reap(self) -> None:
        """Retry, fail or cancel the jobs whose execution expired."""
        m = self.member
        for job_id, owner, outcome in reap(m.connection, self.queues(), m.serializer, self.settings.result_ttl,
                                           self.link.wait_for_redis):
            JobLog(log, job_id).warning("worker %s stopped sending heartbeats; job %s", owner, outcome)
            self.metrics.reaped(outcome.partition(" ")[0])  # retried, failed or canceled
        for sid in shards.put_back_stale(m.connection, time.time() - m.heartbeat_ttl):
            JobLog(log, shards.job_of(sid)).warning("shard %s was taken off its queue by a worker that "
                                                    "did not claim it; queued again", sid)
