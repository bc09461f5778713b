"""The worker process: one engine, loaded once, fed by many rq jobs at a time.

rq's fork-per-job execution does not fit a GPU that must batch requests from several
jobs, so `Consumer` registers as an rq worker but runs its own loop:

    tick   heartbeats (worker, its model's entry in the served models, and each running
           job's execution, which also tells whether a job was reaped meanwhile), reaping (jobs whose worker died), run_at scheduling,
           rq's registry maintenance, timeouts
    admit  while the engine has room: dequeue (high, normal, low priority), mark the job
           started in rq, add its unfinished items to the engine under the job id
    step   one engine step; its events for all jobs go to Redis in one transaction
           (finished samples stored before they are announced) that also reads the running
           jobs' cancel flags and the queue lengths: one round trip per step. A job whose
           samples are all done moves to rq's finished registry and its stream is closed

A job's execution expires `heartbeat_ttl` seconds after its worker's last heartbeat (sent
every third of that); every worker looks for expired ones (worker/reaper.py) every
REAP_INTERVAL seconds and retries their job (it resumes on a live worker), fails it (no retries left: the stream gets
its terminal entry) or cancels it (a cancel was requested).

Redis outages: the loop pauses (the engine keeps its state: nothing leaves this process
but through Redis) and retries with backoff; each write that must not apply twice checks,
after a lost connection, whether it applied (a marker key for the step transaction, this
worker's execution in the started registry for a job's start and end). Once Redis is
back, the first heartbeat drops the jobs that were reaped meanwhile (an outage longer than
the TTL): they run elsewhere.

SIGTERM (or SIGINT): stop taking jobs, let running ones finish for `drain_timeout`
seconds, then hand the rest back (requeued at the front, status `queued`); a second
signal hands back at once. A handed-back or retried job resumes: samples already stored
are not recomputed, and the rest are regenerated with the same seed.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from rq import Queue, worker_registration
from rq.exceptions import DequeueTimeout
from rq.job import Job
from rq.scheduler import RQScheduler
from rq.serializers import JSONSerializer
from rq.utils import as_text, now
from rq.worker import BaseWorker, WorkerStatus

from results import keys, store
from results.publisher import Batch

from . import reaper, shards
from .engine import Engine, EngineError
from .logs import JobLog
from .metrics import WorkerMetrics
from .settings import Settings
from .spec import QUEUE_ORDER, Shard

log = logging.getLogger("fanout.worker")

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)
REAP_INTERVAL = 2.0  # seconds between looks for expired executions: one ZRANGEBYSCORE per queue
MAX_BACKOFF = 5.0  # seconds between tries while Redis is away


def fanout_job(spec: dict) -> None:  # noqa: ARG001
    """The function every Fanout rq job names. Its spec runs inside `fanout worker`."""
    raise RuntimeError("Fanout jobs run in `fanout worker`, which batches them in its engine; "
                       "a plain `rq worker` cannot run them")


def _one_line(e: Exception) -> str:
    """A parse error in one line: pydantic's errors as `loc: message; ...`."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        return "; ".join(f"{'.'.join(map(str, x['loc'])) or 'spec'}: {x['msg']}" for x in errors()[:5])
    return f"{type(e).__name__}: {e}"


@dataclass(slots=True)
class Active:
    """A shard whose requests are in the engine (under the tag of its rq job id)."""
    claim: shards.Claim
    left: dict[int, int]  # item index -> samples not finished yet
    remaining: int  # samples to finish in this attempt
    deadline: float  # monotonic time of the job timeout
    stored: int = 0  # samples this attempt stored (an attempt that stored some is no poison)
    failed_items: set[int] = field(default_factory=set)
    # Unsent deltas: text, token ids, logprobs records (None when not asked).
    pending: dict[tuple[int, int], tuple[str, list[int], list[dict] | None]] = field(default_factory=dict)
    streaming: set[tuple[int, int]] = field(default_factory=set)  # samples whose first delta is out
    max_batch_jobs: int = 0
    custom_ids: list[str | None] | None = None  # per item of the shard, for its stream entries

    @property
    def tag(self) -> str:
        return self.claim.job.id

    @property
    def job_id(self) -> str:
        return self.claim.job_id

    def custom_id(self, index: int) -> str | None:
        return self.custom_ids[index - self.claim.lo] if self.custom_ids else None


class Consumer(BaseWorker):
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
                if self.publish(events) and not self._stop_requested:
                    self.guard(self.admit, False)  # jobs are waiting: join them to the batch
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
        """Take jobs while the engine has room; wait up to 1 s for one when idle."""
        while self.engine.has_room():
            try:
                got = Queue.dequeue_any(self.queues, 1 if block else None, connection=self.connection,
                                        job_class=self.job_class, serializer=self.serializer)
            except DequeueTimeout:
                return
            except REDIS_DOWN as e:
                if not (hasattr(e, "job_id") and len(self.queues) > 1):
                    raise
                # Popped, then the connection broke before the job was read: put it back.
                self.retrying(self._unpop, e.queue, e.job_id)
                return
            if got is None:
                return
            block = False
            self.start(*got)

    def _unpop(self, queue: Queue, job_id: str) -> None:
        if self.connection.lpos(queue.key, job_id) is None:
            self.connection.lpush(queue.key, job_id)

    # -- Redis outages -------------------------------------------------------------

    def wait_for_redis(self, error: Exception) -> None:
        """Pause until Redis answers again: one log line per try, the tries further apart
        each time. The engine keeps its state; once Redis is back, the next heartbeat first
        checks that our jobs were not reaped meanwhile. If Redis came back without writes it
        had acknowledged (a host crash before its append-only file was synced, or no
        persistence), the running jobs are dropped here: they resume from what Redis kept
        once their executions expire."""
        delay, since = 0.25, time.monotonic()
        self.metrics.redis_outages.inc()
        while True:
            if self._stop_requested and self._drain_until is not None and time.monotonic() >= self._drain_until:
                # No hand-back without Redis: the jobs are retried elsewhere once their
                # executions expire.
                for a in list(self.active.values()):
                    self.engine.abort(a.tag)
                self.active.clear()
                raise SystemExit(f"fanout worker: redis unavailable at shutdown ({error}); running jobs "
                                 "are retried elsewhere once their heartbeat expires")
            log.warning("redis unavailable (%s): paused; next try in %.2fs", error, delay)
            time.sleep(delay)
            try:
                seen = self.connection.get(self._marker)
                break
            except REDIS_DOWN as e:
                error, delay = e, min(delay * 2, MAX_BACKOFF)
        log.warning("redis is back after %.1fs; resuming", time.monotonic() - since)
        self.metrics.redis_outage_seconds.inc(time.monotonic() - since)
        self._next_beat = 0.0
        seen = as_text(seen) if seen is not None else None
        if seen is not None and seen == self._sending:
            self._sent = seen  # the step transaction in flight applied; only its reply was lost
        elif seen != self._sent:
            self._sent = seen
            if self.active:
                log.error("redis came back without writes it had acknowledged: dropping %d running jobs; "
                          "they resume from what redis kept once their heartbeat expires", len(self.active))
            for a in list(self.active.values()):
                self.drop(a)

    def retrying(self, fn, *args, **kwargs):
        """fn(...) until Redis answers it: only for calls that may run twice."""
        while True:
            try:
                return fn(*args, **kwargs)
            except REDIS_DOWN as e:
                self.wait_for_redis(e)

    def guard(self, fn, *args):
        """fn(*args), or None after waiting out a Redis outage. Only housekeeping that may run
        again comes here (reads, heartbeats, reaping, rq's scheduler and maintenance,
        dequeues); writes that must apply once are retried where they are made."""
        try:
            return fn(*args)
        except REDIS_DOWN as e:
            self.wait_for_redis(e)
            return None

    def send(self, batch: Batch) -> list | None:
        """Send `batch` exactly once, across Redis outages. Returns the answers of its reads,
        or None if it was dropped: one of its jobs was reaped during a long outage (the
        others are handed back: they resume from what Redis stored), or Redis lost writes
        (see wait_for_redis)."""
        self._sends += 1
        self._sending = mark = str(self._sends)
        batch.pipe.set(self._marker, mark, ex=24 * 3600)
        holding = list(self.active)
        try:
            while True:
                try:
                    answers = batch.send()
                    self._sent = mark
                    return answers
                except REDIS_DOWN as e:
                    self.wait_for_redis(e)  # it reads the marker
                if self._sent == mark:
                    return self.retrying(self._read, batch)
                self.retrying(self.beat)
                if any(tag not in self.active for tag in holding):
                    for a in [a for a in self.active.values() if a.job_id in batch.jobs]:
                        self.hand_back(a, "redis was unavailable for too long; shard handed back")
                    return None
        finally:
            self._sending = None

    def _read(self, batch: Batch) -> list:
        with self.connection.pipeline(transaction=False) as pipe:
            for command, args in batch.reads:
                getattr(pipe, command)(*args)
            return pipe.execute()

    # -- heartbeats and reaping ------------------------------------------------------

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
                 "images": self.image_schemes}))
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

    def drop(self, a: Active) -> None:
        """Forget a job here without writing anything for it."""
        self.engine.abort(a.tag)
        self._done(a)
        self.metrics.attempt("dropped")

    def reap(self) -> None:
        """Retry, fail or cancel the jobs whose execution expired (worker/reaper.py)."""
        for job_id, owner, outcome in reaper.reap(self.connection, self.queues, self.serializer,
                                                  self.settings.result_ttl, self.wait_for_redis):
            JobLog(log, job_id).warning("worker %s stopped sending heartbeats; job %s", owner, outcome)
            self.metrics.reaped(outcome.partition(" ")[0])  # retried, failed or canceled

    # -- one shard's lifecycle (its transitions in Redis: worker/shards.py) ---------------

    def _busy(self, pipe) -> None:
        self.set_state(WorkerStatus.BUSY, pipeline=pipe)
        self.heartbeat(pipeline=pipe)

    def start(self, job: Job, queue: Queue) -> None:
        c = shards.claim(self.connection, job, queue, self.name, self.heartbeat_ttl, self._busy,
                         self.wait_for_redis)
        if c is None:
            JobLog(log, job.id).info("not queued any more, or its job ended; skipped")
            return
        self.executions[c.execution.id] = c.execution
        a = Active(c, left={}, remaining=0,
                   deadline=time.monotonic() + (job.timeout if job.timeout and job.timeout > 0 else 1e12))
        self.active[job.id] = a
        try:
            spec = self.retrying(self.read_shard, c)
        except Exception as e:  # not a job our API made (or made by another version): no retry
            self.fail(a, f"bad job payload: {_one_line(e)}", retry=False, abort=False)
            return
        a.custom_ids = spec.custom_ids
        JobLog(log, c.job_id).info("shard %d (items %d-%d), attempt %d, %d samples stored before",
                                   c.k, c.lo, c.hi - 1, c.attempt, len(c.stored))
        batch = Batch(self.connection)
        batch.info(c.job_id, model=self.model)
        batch.expire(c.job_id, self.settings.job_timeout + self.settings.result_ttl)
        todo, todo_params = [], []
        for local, (item, p) in enumerate(zip(spec.items, spec.sampling_params)):
            index = c.lo + local
            left = [j for j in range(p.n) if (index, j) not in c.stored]
            if not left:
                continue
            a.left[index] = len(left)
            a.remaining += len(left)
            try:
                todo.append(self.engine_item(spec.kind, index, item))
                todo_params.append(p)
            except ValueError as e:  # this item alone fails
                for j in left:
                    self.record(batch, a, index, j, store.sample_record("", [], "error", None, str(e)))
        self.send(batch)
        if job.id not in self.active:  # dropped: Redis was away longer than the TTL
            return
        if todo:
            try:
                self.engine.add(job.id, todo, todo_params, seed=spec.seed)
            except ValueError as e:  # the job's input: retrying cannot help
                self.fail(a, f"ValueError: {e}", retry=False)
                return
            except Exception:
                self.fail(a, traceback.format_exc())
                return
        if a.remaining == 0:
            self.succeed(a)

    def read_shard(self, c: shards.Claim) -> Shard:
        """The shard's items from the job's item list."""
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.lrange(keys.items(c.job_id), c.lo, c.hi - 1)
            pipe.lrange(keys.custom_ids(c.job_id), c.lo, c.hi - 1)
            entries, custom = pipe.execute()
        if len(entries) != c.hi - c.lo:
            raise ValueError(f"the job's items {c.lo}-{c.hi - 1} are gone (the job expired?)")
        return Shard.read(c.info["kind"], int(c.info["seed"]), c.info.get("params"), entries, custom, c.lo)

    def engine_item(self, kind: str, index: int, item: Any) -> tuple:
        """A job item -> the engine's (index, prompt, input_ids); ValueError fails the item."""
        if kind == "prompts":
            return (index, item, None)
        if kind == "messages":
            # A chat: the engine renders its template and decodes its images (chat.py); a
            # bad chat or image fails its item alone, in the engine's events.
            return (index, [m.chat_dict() for m in item], None)
        return (index, None, item)  # the engine fails an item with an id outside the vocabulary

    def record(self, batch: Batch, a: Active, index: int, sample: int, rec: dict,
               text_delta: str = "", ids_delta: list[int] | None = None) -> None:
        """Store and announce one finished sample."""
        a.left[index] -= 1
        a.remaining -= 1
        a.stored += 1
        if rec["finish_reason"] == "error":
            a.failed_items.add(index)
        self.metrics.sample(rec["finish_reason"], rec["usage"])
        batch.final(a.job_id, index, sample, text_delta, ids_delta or [], rec,
                    item_done=a.left[index] == 0, item_failed=index in a.failed_items,
                    custom_id=a.custom_id(index))

    def publish(self, events: list) -> bool:
        """One step's events -> one Redis transaction, which also reads the cancel flags and
        the queue lengths; then finish the completed shards and cancel the flagged ones.
        Returns whether shards are waiting in the queues."""
        if time.monotonic() >= self._next_beat:  # after a long step: are the shards still ours?
            self.retrying(self.beat)
        batch = Batch(self.connection)
        in_step = {ev.tag for ev in events if ev.tag in self.active}
        jobs_in_step = {self.active[t].job_id for t in in_step}
        for job_id in jobs_in_step:
            batch.counts[job_id]["steps"] += 1
        for tag in in_step:
            a = self.active[tag]
            if len(jobs_in_step) > a.max_batch_jobs:
                a.max_batch_jobs = len(jobs_in_step)
                batch.at_least(a.job_id, "max_batch_jobs", a.max_batch_jobs)
        for ev in events:
            a = self.active.get(ev.tag)
            if a is None or (ev.index, ev.sample) in a.claim.stored:
                continue  # a canceled / handed-back shard, or a sample stored by an earlier attempt
            key = (ev.index, ev.sample)
            text, ids, lps = a.pending.pop(key, ("", [], None))
            text, ids = text + ev.text_delta, ids + ev.token_ids_delta
            if ev.logprobs_delta is not None:
                lps = (lps or []) + ev.logprobs_delta
            if not ev.finished:
                if key not in a.streaming:  # a sample's first tokens go out at once
                    a.streaming.add(key)
                    batch.delta(a.job_id, ev.index, ev.sample, text, ids, lps, a.custom_id(ev.index))
                elif text or ids:
                    a.pending[key] = (text, ids, lps)
                continue
            usage = None
            if ev.usage is not None:
                usage = {"prompt_tokens": ev.usage.prompt_tokens, "cached_tokens": ev.usage.cached_tokens,
                         "completion_tokens": ev.usage.completion_tokens}
            rec = store.sample_record(ev.text or "", ev.token_ids or [], ev.finish_reason, usage, ev.error,
                                      ev.logprobs)
            self.record(batch, a, ev.index, ev.sample, rec, text, ids)
        t = time.monotonic()
        if t >= self._next_flush:
            self._next_flush = t + self.delta_interval
            for a in self.active.values():
                for (index, sample), (text, ids, lps) in a.pending.items():
                    batch.delta(a.job_id, index, sample, text, ids, lps, a.custom_id(index))
                a.pending.clear()
        tags = list(self.active)
        if tags:
            batch.read("mget", [keys.cancel(self.active[t].job_id) for t in tags])
        for q in self.queues:
            batch.read("llen", q.key)
        answers = self.send(batch)
        if answers is None:
            return False
        for tag in in_step:
            a = self.active.get(tag)
            if a is not None and a.remaining == 0:
                self.succeed(a)
        if tags:
            for tag, flag in zip(tags, answers[0]):
                if flag is not None and tag in self.active:
                    self.cancel(self.active[tag])
        return any(answers[-len(self.queues):])

    def _done(self, a: Active) -> None:
        del self.active[a.tag]
        self.executions.pop(a.claim.execution.id, None)
        if not self.active:
            self.retrying(self.set_state, WorkerStatus.IDLE)

    def _settle(self, a: Active, outcome: str, error: str | None = None) -> str | None:
        """End this attempt of the shard in Redis (worker/shards.py), once, across outages."""
        c = a.claim
        return shards.settle(self.connection, c.job_id, c.k, c.job, c.execution, outcome,
                             self.settings.result_ttl, self.wait_for_redis, error=error,
                             progressed=a.stored > 0)

    def succeed(self, a: Active) -> None:
        self._done(a)
        if self._settle(a, shards.DONE) is not None:
            JobLog(log, a.job_id).info("shard %d done", a.claim.k)
            self.metrics.attempt("succeeded")

    def fail(self, a: Active, exc_string: str, retry: bool = True, abort: bool = True) -> None:
        """Abort the shard's requests and fail this attempt: retried (a strike unless it
        stored samples) while the shard has strikes left and `retry`, else its job fails."""
        if abort:
            self.engine.abort(a.tag)
        self._done(a)
        message = exc_string.strip().splitlines()[-1]
        applied = self._settle(a, shards.RETRY if retry else shards.FAILED, message)
        if applied == shards.FAILED:
            self.retrying(shards.drop_queued, self.connection, a.job_id)
            JobLog(log, a.job_id).warning("failed: %s", message)
            self.metrics.attempt("failed")
        elif applied == shards.RETRY:
            JobLog(log, a.job_id).warning("shard %d attempt failed, retrying: %s", a.claim.k, message)
            self.metrics.attempt("retried")

    def cancel(self, a: Active) -> None:
        """Abort now (KV freed at once); finished samples stay stored."""
        n = self.engine.abort(a.tag)
        self._done(a)
        if self._settle(a, shards.CANCELED) is not None:
            self.retrying(shards.drop_queued, self.connection, a.job_id)
            JobLog(log, a.job_id).info("shard %d canceled, %d requests aborted", a.claim.k, n)
            self.metrics.attempt("canceled")

    def hand_back(self, a: Active, reason: str = "worker shut down; shard handed back") -> None:
        """Requeue the shard at the front, as if never started (no strike)."""
        self.engine.abort(a.tag)
        self._done(a)
        if self._settle(a, shards.HANDED_BACK, reason) is not None:
            JobLog(log, a.job_id).info("shard %d handed back to queue %s", a.claim.k, a.claim.queue.name)
            self.metrics.attempt("handed_back")
