"""The worker process: one engine, loaded once, fed by the shards of many jobs at a time.

rq's fork-per-job execution does not fit a GPU that must batch requests from several
jobs, so `Consumer` registers as an rq worker but runs its own loop:

    tick   heartbeats (worker, its model's entry in the served models, and each running
           shard's execution, which also tells whether a shard was reaped meanwhile),
           reaping (shards whose worker died: worker/reaper.py), run_at scheduling, rq's
           registry maintenance, timeouts
    admit  while the engine has room: dequeue a shard (high, normal, low priority), claim
           it (jobs/shards.py), read its slice of the job's items and add the unfinished
           ones to the engine under the shard's id (the job is their owner: the engine
           shares its slots fairly between jobs). A full engine still takes a shard of a
           job it runs nothing of, from the head of the first queue that holds shards, so
           a small job starts beside a huge one (the engine retracts some of the huge
           one's samples to give it its share)
    step   one engine step; its events for all shards go to Redis in one transaction
           (worker/publish.py), which also reads the cancel flags and the queue lengths:
           one round trip per step. A shard whose samples are all done ends (settle), and
           the job with it if it was the last

Where the rest is: one attempt of a shard here, from its claim to its end (start, succeed,
fail, cancel, hold, hand back, drop), and the invariant on `active`: worker/attempts.py; a
shard's transitions in Redis, each one transaction with its invariants: jobs/shards.py;
publishing a step: worker/publish.py; riding out Redis outages: worker/outage.py; dead
workers' shards: worker/reaper.py.

SIGTERM (or SIGINT): stop taking shards, let running ones finish for `drain_timeout`
seconds, then hand the rest back (requeued at the front); a second signal hands back at
once. A handed-back or retried shard resumes: samples already stored are not recomputed,
and the rest are regenerated with the same seed.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
import traceback

from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue, worker_registration
from rq.exceptions import DequeueTimeout, NoSuchJobError
from rq.job import Job
from rq.scheduler import RQScheduler
from rq.serializers import JSONSerializer
from rq.utils import as_text, now
from rq.worker import BaseWorker, WorkerStatus

from results import blobs, keys

from . import reaper, shards
from .attempts import Active, Attempts
from .outage import REDIS_DOWN, Outages
from .publish import Publishing
from .engine import Engine, EngineError
from .logs import JobLog
from .metrics import WorkerMetrics
from .settings import Settings
from .spec import QUEUE_ORDER

log = logging.getLogger("fanout.worker")

REAP_INTERVAL = 2.0  # seconds between looks for expired executions: one ZRANGEBYSCORE per queue


def fanout_job(spec: dict) -> None:  # noqa: ARG001
    """The function every Fanout rq job names. Its spec runs inside `fanout worker`."""
    raise RuntimeError("Fanout jobs run in `fanout worker`, which batches them in its engine; "
                       "a plain `rq worker` cannot run them")


class Consumer(Attempts, Outages, Publishing, BaseWorker):
    def __init__(self, engine: Engine, connection, settings: Settings, queues=None,
                 name: str | None = None, drain_timeout: float = 30.0, delta_interval: float = 0.1,
                 model: str = "model"):
        # Connection errors come to this loop, which knows whether a write may be sent again;
        # redis-py's own retries would send a transaction again whose reply was lost.
        connection.set_retry(Retry(NoBackoff(), 0))
        super().__init__(queues or QUEUE_ORDER, name=name, connection=connection,
                         serializer=JSONSerializer, default_result_ttl=settings.result_ttl)
        self.engine = engine
        self.metrics = WorkerMetrics(self.name)
        self.metrics.watch(self)
        self.model = model  # the name it serves under: GET /v1/models, a request's `model`, job status
        self._model_since = int(time.time())
        # The image URL schemes its chats take, [] for a text model: the API's check of image parts.
        self.image_schemes = engine.image_schemes()
        self.settings = settings
        self.blobs = blobs.open_store(settings.storage_url)  # the items of jobs that keep them there
        self.drain_timeout = drain_timeout
        self.heartbeat_ttl = settings.heartbeat_ttl
        self.heartbeat_s = settings.heartbeat_ttl / 3
        # After its first tokens, a sample's deltas are sent together at most every
        # delta_interval seconds: one stream entry per sample per flush, not per token.
        self.delta_interval = delta_interval
        self._next_flush = 0.0
        self.active: dict[str, Active] = {}
        self.delayed = RQScheduler(self.queues, connection, serializer=JSONSerializer)
        self._drain_until: float | None = None
        self._next_beat = 0.0
        self._next_reap = 0.0
        self._next_schedule = 0.0
        # Every step transaction also sets this key (this process's own) to a new value:
        # after a lost connection, reading it tells whether the transaction applied.
        self._marker = f"fanout:worker:{self.name}:{os.urandom(4).hex()}:sent"
        self._sends = 0
        self._sent: str | None = None  # the marker of the last transaction Redis acknowledged
        self._sending: str | None = None  # the marker of the transaction in flight

    def execute_job(self, job: Job, queue: Queue):
        raise NotImplementedError("Consumer batches jobs in its run loop, not one at a time")

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # rq's (90 s and more) made a dead worker's job wait minutes; our heartbeats are frequent.
        return self.heartbeat_ttl

    def _pubsub_exception_handler(self, exc, pubsub, pubsub_thread) -> None:
        # rq logs an error every 2 s while Redis is away; the loop already says so, less often.
        if isinstance(exc, REDIS_DOWN):
            time.sleep(2.0)
            return
        super()._pubsub_exception_handler(exc, pubsub, pubsub_thread)

    # -- the loop ------------------------------------------------------------------

    def run(self, burst: bool = False) -> None:
        """Work until SIGTERM / SIGINT (or, with burst, until the queues are empty)."""
        self.bootstrap()
        self.retrying(self.share_tokenizer)
        self.retrying(self.beat)  # the model is listed before this worker says it is ready
        self.set_state(WorkerStatus.IDLE)
        self._install_signal_handlers()
        try:
            while True:
                ready = self.guard(self.ready, burst)
                if ready is False:
                    break
                if not ready:
                    continue
                t = time.perf_counter()
                try:
                    events = self.engine.step()
                except EngineError:
                    # No request to blame (a request that makes a step fail ends alone, as a
                    # failed item): the engine's state is in doubt. Fail the jobs (retried if
                    # they have retries left) and exit; a supervisor restarts the worker.
                    exc = traceback.format_exc()
                    log.error("engine step failed; exiting:\n%s", exc,  # the CLI says only its last line
                              extra={"job_ids": list(self.active)})
                    for a in list(self.active.values()):
                        self.fail(a, exc, abort=False)
                    raise
                self.metrics.step_seconds.observe(time.perf_counter() - t)
                queued, heads = self.publish(events)
                if queued and not self._stop_requested:  # shards are waiting: join them to the batch
                    if heads is None:
                        self.guard(self.admit, False)
                    else:
                        self.guard(self.admit_new_job, heads)
        finally:
            for a in list(self.active.values()):
                self.hand_back(a)
            try:
                if self.delayed.acquired_locks:
                    self.delayed.release_locks()
                self.teardown()
            except REDIS_DOWN as e:
                log.warning("redis unavailable at exit (%s): this worker's registration expires by itself", e)

    def ready(self, burst: bool) -> bool | None:
        """Housekeeping, and jobs if the engine is idle. True: step the engine; False: stop;
        None: come again."""
        self.tick()
        if self._stop_requested and not self.active:
            return False
        if not self.engine.has_work():  # idle: wait (1 s at most) for a job
            if not self._stop_requested:
                self.admit(block=not burst)
            if not self.engine.has_work():
                return False if burst and not self.active else None
        return True

    def _install_signal_handlers(self):
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        # Only flags here: the loop acts on them between engine steps.
        if self._stop_requested:
            log.warning("second signal: handing back %d running jobs now", len(self.active))
            self._drain_until = 0.0
            return
        log.info("warm shutdown: no new jobs; %d running get %.0fs to finish",
                 len(self.active), self.drain_timeout)
        self._stop_requested = True
        self._shutdown_requested_date = now()
        self._drain_until = time.monotonic() + self.drain_timeout

    def tick(self) -> None:
        t = time.monotonic()
        if t >= self._next_beat:
            self.beat()
        if t >= self._next_reap:
            self._next_reap = t + REAP_INTERVAL
            self.reap()
        if t >= self._next_schedule:  # move due run_at jobs (and retries) to their queues
            self._next_schedule = t + 1.0
            if self.delayed.should_reacquire_locks:
                self.delayed.acquire_locks()
            if self.delayed.acquired_locks:
                self.delayed.heartbeat()
                self.delayed.enqueue_scheduled_jobs()
        if self.should_run_maintenance_tasks:
            self.run_maintenance_tasks()
        for a in [a for a in self.active.values() if t > a.deadline]:
            self.fail(a, f"JobTimeoutException: shard exceeded its timeout of {a.claim.job.timeout}s")
        if self._drain_until is not None and t >= self._drain_until:
            for a in list(self.active.values()):
                self.hand_back(a)

    def admit(self, block: bool) -> None:
        """Take shards while the engine has room; wait up to 1 s for one when idle. A shard
        is taken off its queue and recorded as being taken in one script (shards.take): a
        worker that dies before its claim leaves it to the reapers, who queue it again."""
        while self.engine.has_room():
            got = shards.take(self.connection, self.queues, time.time())
            if got is None and block:
                got = self._wait_for_shard()
            if got is None:
                return
            block = False
            queue, sid = got
            try:
                job = Job.fetch(sid, connection=self.connection, serializer=self.serializer)
            except NoSuchJobError:  # its job ended and took it along
                shards.untake(self.connection, sid)
                continue
            self.start(job, queue)

    def _wait_for_shard(self) -> tuple[Queue, str] | None:
        """Idle: block up to 1 s for a shard on any queue (rq's BLPOP; the one pop that is
        recorded as taken only after it, a moment later)."""
        try:
            got = Queue.dequeue_any(self.queues, 1, connection=self.connection,
                                    job_class=self.job_class, serializer=self.serializer)
        except DequeueTimeout:
            return None
        except REDIS_DOWN as e:
            if not (hasattr(e, "job_id") and len(self.queues) > 1):
                raise
            # Popped, then the connection broke before the job was read: put it back.
            self.retrying(self._unpop, e.queue, e.job_id)
            return None
        if got is None:
            return None
        job, queue = got
        shards.mark_taken(self.connection, queue, job.id, time.time())
        return queue, job.id

    def admit_new_job(self, heads: list[list[bytes]]) -> None:
        """A full engine: take the first shard in `heads` (the queues' first ids) of a job
        with nothing here, from the first queue (by priority) holding shards: a lower queue
        is looked at only when the higher ones are empty, so high still passes normal."""
        mine = {a.job_id for a in self.active.values()}
        for queue, ids in zip(self.queues, heads):
            if not ids:
                continue
            for sid in map(as_text, ids):
                # Whoever takes the id out of the queue holds it (recorded as being taken).
                if shards.job_of(sid) not in mine and shards.take_id(self.connection, queue, sid, time.time()):
                    try:
                        job = Job.fetch(sid, connection=self.connection, serializer=self.serializer)
                    except NoSuchJobError:
                        shards.untake(self.connection, sid)
                        return
                    self.start(job, queue)  # (a lost reply: the reapers queue it again)
                    return
            return

    def _unpop(self, queue: Queue, job_id: str) -> None:
        if self.connection.lpos(queue.key, job_id) is None:
            self.connection.lpush(queue.key, job_id)

    # -- heartbeats and reaping ------------------------------------------------------

    def share_tokenizer(self) -> None:
        """The model's tokenizer files in Redis (keys.tokenizer), for the API's /tokenize: the
        API never reads a model's files. Written in one transaction, with their digest."""
        import hashlib
        import tempfile

        try:
            with tempfile.TemporaryDirectory() as tmp:
                self.engine.tokenizer.save_pretrained(tmp)
                files = {}
                for name in sorted(os.listdir(tmp)):
                    with open(os.path.join(tmp, name), "rb") as f:
                        files[name] = f.read()
        except Exception as e:  # noqa: BLE001 - the model serves all the same, /tokenize answers 503
            log.warning("the tokenizer could not be saved for the API's /tokenize: %s: %s", type(e).__name__, e)
            return
        digest = hashlib.blake2b(b"".join(n.encode() + b"\0" + d for n, d in files.items()), digest_size=8)
        with self.connection.pipeline() as pipe:
            pipe.delete(keys.tokenizer(self.model))
            pipe.hset(keys.tokenizer(self.model), mapping={**files, "digest": digest.hexdigest()})
            pipe.execute()

    def beat(self) -> None:
        """Heartbeat the worker and each running job's execution, in one transaction that
        first reads whether each execution is still registered. One that is not was reaped
        (this worker stalled, or Redis was away, longer than the TTL): its job runs
        elsewhere now and is dropped here."""
        self._next_beat = time.monotonic() + self.heartbeat_s
        actives = list(self.active.values())
        with self.connection.pipeline() as pipe:
            for a in actives:
                pipe.zscore(a.claim.job.started_job_registry.key, a.claim.execution.composite_key)
            self.heartbeat(pipeline=pipe)
            for a in actives:
                a.claim.execution.heartbeat(a.claim.job.started_job_registry, self.heartbeat_ttl, pipeline=pipe)
            pipe.hset(keys.models(), self.model, json.dumps(
                {"created": self._model_since, "expires": time.time() + self.heartbeat_ttl,
                 "images": self.image_schemes, "max_model_len": self.engine.max_context,
                 "tools": self.engine.front.tool_format}))
            answers = pipe.execute()
        if answers[len(actives)] == 1:  # our worker key was new: Redis lost it, so register again
            with self.connection.pipeline() as pipe:
                pipe.hset(self.key, mapping=self.serialize())
                worker_registration.register(self, pipe)
                pipe.execute()
        for a, score in zip(actives, answers):
            if score is None and a.tag in self.active:
                JobLog(log, a.job_id).warning("shard %d reaped while this worker could not heartbeat it; "
                                              "dropped here", a.claim.k)
                self.drop(a)

    def clean_registries(self) -> None:
        """rq's maintenance of the queues' registries (at start, then every 10 minutes), but
        an expired execution in a StartedJobRegistry is the reaper's alone. rq's own cleanup
        of it would mark the shard's rq job failed (AbandonedJobError) with no stream entry
        and no retry, and the job would hang: a worker that started as a dead worker's
        heartbeat expired once did that, between its reap and this maintenance (the scores
        are whole seconds)."""
        self.reap()
        for queue in self.queues:
            if queue.acquire_maintenance_lock():
                log.info("worker %s: cleaning registries for queue %s", self.name, queue.name)
                for registry in (queue.finished_job_registry, queue.failed_job_registry,
                                 queue.deferred_job_registry, queue.ready_job_registry):
                    registry.cleanup()
                worker_registration.clean_worker_registry(queue)
                queue.intermediate_queue.cleanup(self, queue)
                queue.release_maintenance_lock()
        self.last_cleaned_at = now()

    def reap(self) -> None:
        """Retry, fail or cancel the jobs whose execution expired (worker/reaper.py)."""
        for job_id, owner, outcome in reaper.reap(self.connection, self.queues, self.serializer,
                                                  self.settings.result_ttl, self.wait_for_redis):
            JobLog(log, job_id).warning("worker %s stopped sending heartbeats; job %s", owner, outcome)
            self.metrics.reaped(outcome.partition(" ")[0])  # retried, failed or canceled
        for sid in shards.put_back_stale(self.connection, time.time() - self.heartbeat_ttl):
            JobLog(log, shards.job_of(sid)).warning("shard %s was taken off its queue by a worker that "
                                                    "did not claim it; queued again", sid)
