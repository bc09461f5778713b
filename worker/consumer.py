"""The worker process: one engine, loaded once, fed by many rq jobs at a time.

rq's fork-per-job execution does not fit a GPU that must batch requests from several
jobs, so `Consumer` registers as an rq worker but runs its own loop:

    tick   heartbeats (worker, and each running job's execution so it is never reaped as
           abandoned), run_at scheduling, registry maintenance, timeouts
    admit  while the engine has room: dequeue (high, normal, low priority), mark the job
           started in rq, add its unfinished items to the engine under the job id
    step   one engine step; its events for all jobs go to Redis in one transaction
           (finished samples stored before they are announced) that also reads the running
           jobs' cancel flags and the queue lengths: one round trip per step. A job whose
           samples are all done moves to rq's finished registry and its stream is closed

SIGTERM (or SIGINT): stop taking jobs, let running ones finish for `drain_timeout`
seconds, then hand the rest back (requeued at the front, status `queued`); a second
signal hands back at once. A handed-back or retried job resumes: samples already stored
are not recomputed, and the rest are regenerated with the same seed.
"""
from __future__ import annotations

import logging
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from rq import Queue
from rq.exceptions import DequeueTimeout
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry
from rq.scheduler import RQScheduler
from rq.serializers import JSONSerializer
from rq.utils import now, utcformat
from rq.worker import BaseWorker, WorkerStatus

from results import events, keys, progress, publisher, store
from results.publisher import Batch

from .engine import Engine
from .settings import Settings
from .spec import QUEUE_ORDER, JobSpec

log = logging.getLogger("fanout.worker")


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
    """A job whose requests are in the engine."""
    job: Job
    queue: Queue
    execution: Execution
    left: dict[int, int]  # item index -> samples not finished yet
    skip: set[tuple[int, int]]  # (index, sample) stored by an earlier attempt
    remaining: int  # samples to finish in this attempt
    deadline: float  # monotonic time of the job timeout
    failed_items: set[int] = field(default_factory=set)
    # Unsent deltas: text, token ids, logprobs records (None when not asked).
    pending: dict[tuple[int, int], tuple[str, list[int], list[dict] | None]] = field(default_factory=dict)
    streaming: set[tuple[int, int]] = field(default_factory=set)  # samples whose first delta is out
    steps: int = 0
    max_batch_jobs: int = 0


class Consumer(BaseWorker):
    def __init__(self, engine: Engine, connection, settings: Settings, queues=None,
                 name: str | None = None, drain_timeout: float = 30.0, heartbeat_s: float = 10.0,
                 delta_interval: float = 0.1):
        super().__init__(queues or QUEUE_ORDER, name=name, connection=connection,
                         serializer=JSONSerializer, default_result_ttl=settings.result_ttl)
        self.engine = engine
        self.settings = settings
        self.drain_timeout = drain_timeout
        self.heartbeat_s = heartbeat_s
        # After its first tokens, a sample's deltas are sent together at most every
        # delta_interval seconds: one stream entry per sample per flush, not per token.
        self.delta_interval = delta_interval
        self._next_flush = 0.0
        self.active: dict[str, Active] = {}
        self.delayed = RQScheduler(self.queues, connection, serializer=JSONSerializer)
        self._drain_until: float | None = None
        self._next_beat = 0.0
        self._next_schedule = 0.0

    def execute_job(self, job: Job, queue: Queue):
        raise NotImplementedError("Consumer batches jobs in its run loop, not one at a time")

    # -- the loop ------------------------------------------------------------------

    def run(self, burst: bool = False) -> None:
        """Work until SIGTERM / SIGINT (or, with burst, until the queues are empty)."""
        self.bootstrap()
        self.set_state(WorkerStatus.IDLE)
        self._install_signal_handlers()
        try:
            while True:
                self.tick()
                if self._stop_requested and not self.active:
                    break
                if not self.engine.has_work():  # idle: wait (1 s at most) for a job
                    if not self._stop_requested:
                        self.admit(block=not burst)
                    if not self.engine.has_work():
                        if burst and not self.active:
                            break
                        continue
                try:
                    events = self.engine.step()
                except Exception:
                    # The engine's state is unknown now: give the jobs back to rq (retried
                    # if they have retries left) and exit; a supervisor restarts the worker.
                    exc = traceback.format_exc()
                    log.error("engine step failed; exiting:\n%s", exc)  # the CLI says only its last line
                    for a in list(self.active.values()):
                        self.fail(a, exc, abort=False)
                    raise
                if self.publish(events) and not self._stop_requested:
                    self.admit(block=False)  # jobs are waiting: join them to the batch
        finally:
            for a in list(self.active.values()):
                self.hand_back(a)
            if self.delayed.acquired_locks:
                self.delayed.release_locks()
            self.teardown()

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
            self._next_beat = t + self.heartbeat_s
            for a in self.active.values():
                self.maintain_heartbeats(a.job, a.execution)
            if not self.active:
                self.heartbeat()
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
            self.fail(a, f"JobTimeoutException: job exceeded its timeout of {a.job.timeout}s")
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
            if got is None:
                return
            block = False
            self.start(*got)

    # -- one job's lifecycle -----------------------------------------------------------

    def start(self, job: Job, queue: Queue) -> None:
        execution = self.prepare_execution(job)  # StartedJobRegistry entry, worker busy
        self.prepare_job_execution(job, remove_from_intermediate_queue=len(self.queues) == 1)
        try:
            spec = JobSpec.model_validate(job.kwargs["spec"])
        except Exception as e:  # not a job our API made (or made by another version): no retry
            self.fail_now(job, queue, execution, f"bad job payload: {_one_line(e)}")
            return
        params = spec.sampling_params
        ns = [p.n for p in params]
        job_id = job.id
        skip = store.finished(self.connection, job_id)
        attempt = self.connection.hincrby(keys.info(job_id), "attempt", 1)
        a = Active(job, queue, execution, left={}, skip=skip, remaining=0,
                   deadline=time.monotonic() + (job.timeout if job.timeout and job.timeout > 0 else 1e12))
        self.active[job_id] = a
        log.info("job %s: attempt %d, %d items, %d samples stored before", job_id, attempt,
                 len(ns), len(skip))

        batch = Batch(self.connection)
        batch.pipe.hset(keys.info(job_id), mapping={"total": len(ns), "samples": sum(ns)})
        batch.expire(job_id, self.settings.job_timeout + self.settings.result_ttl)
        batch.attempt(job_id, attempt, self.name)
        batch.status(job_id, "running")
        todo, todo_params = [], []
        for index, (item, p) in enumerate(zip(spec.items, params)):
            left = [j for j in range(p.n) if (index, j) not in skip]
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
        batch.send()
        if todo:
            try:
                self.engine.add(job_id, todo, todo_params, seed=spec.seed)
            except ValueError as e:  # the job's input: retrying cannot help
                self.fail(a, f"ValueError: {e}", retry=False)
                return
            except Exception:
                self.fail(a, traceback.format_exc())
                return
        if a.remaining == 0:
            self.succeed(a)

    def engine_item(self, kind: str, index: int, item: Any) -> tuple:
        """A job item -> the engine's (index, prompt, input_ids); ValueError fails the item."""
        if kind == "prompts":
            return (index, item, None)
        if kind == "messages":
            tok = self.engine.tokenizer
            try:
                text = tok.apply_chat_template([m.model_dump() for m in item], tokenize=False,
                                               add_generation_prompt=True)
            except Exception as e:
                raise ValueError(f"messages[{index}]: chat template failed: {e}") from None
            # The template already holds the special tokens (BOS) it wants.
            return (index, None, tok(text, add_special_tokens=False)["input_ids"])
        return (index, None, item)  # the engine fails an item with an id outside the vocabulary

    def record(self, batch: Batch, a: Active, index: int, sample: int, rec: dict,
               text_delta: str = "", ids_delta: list[int] | None = None) -> None:
        """Store and announce one finished sample."""
        a.left[index] -= 1
        a.remaining -= 1
        if rec["finish_reason"] == "error":
            a.failed_items.add(index)
        batch.final(a.job.id, index, sample, text_delta, ids_delta or [], rec,
                    item_done=a.left[index] == 0, item_failed=index in a.failed_items)

    def publish(self, events: list) -> bool:
        """One step's events -> one Redis transaction, which also reads the cancel flags and
        the queue lengths; then finish the completed jobs and cancel the flagged ones.
        Returns whether jobs are waiting in the queues."""
        batch = Batch(self.connection)
        in_step = {ev.tag for ev in events if ev.tag in self.active}
        for job_id in in_step:
            a = self.active[job_id]
            a.steps += 1
            a.max_batch_jobs = max(a.max_batch_jobs, len(in_step))
        for ev in events:
            a = self.active.get(ev.tag)
            if a is None or (ev.index, ev.sample) in a.skip:
                continue  # a canceled / handed-back job, or a sample stored by an earlier attempt
            key = (ev.index, ev.sample)
            text, ids, lps = a.pending.pop(key, ("", [], None))
            text, ids = text + ev.text_delta, ids + ev.token_ids_delta
            if ev.logprobs_delta is not None:
                lps = (lps or []) + ev.logprobs_delta
            if not ev.finished:
                if key not in a.streaming:  # a sample's first tokens go out at once
                    a.streaming.add(key)
                    batch.delta(a.job.id, ev.index, ev.sample, text, ids, lps)
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
                    batch.delta(a.job.id, index, sample, text, ids, lps)
                a.pending.clear()
                self._batching(batch, a)
        ids = list(self.active)
        if ids:
            batch.read("mget", [keys.cancel(i) for i in ids])
        for q in self.queues:
            batch.read("llen", q.key)
        answers = batch.send()
        for job_id in in_step:
            a = self.active.get(job_id)
            if a is not None and a.remaining == 0:
                self.succeed(a)
        if ids:
            for job_id, flag in zip(ids, answers[0]):
                if flag is not None and job_id in self.active:
                    self.cancel(self.active[job_id])
        return any(answers[-len(self.queues):])

    @staticmethod
    def _batching(batch: Batch, a: Active) -> None:
        batch.pipe.hset(keys.info(a.job.id), mapping={"steps": a.steps, "max_batch_jobs": a.max_batch_jobs})

    def _done(self, a: Active) -> None:
        del self.active[a.job.id]
        if not self.active:
            self.set_state(WorkerStatus.IDLE)

    def _counts(self, job_id: str) -> dict:
        info = progress.read(self.connection, job_id) or {}
        return {k: info.get(k) for k in ("done", "total", "failed")}

    def succeed(self, a: Active) -> None:
        self._done(a)
        job = a.job
        job.ended_at = now()
        batch = Batch(self.connection)
        self._batching(batch, a)
        batch.send()
        counts = self._counts(job.id)
        job._result = counts  # rq's job result (JSON): the counts; the outputs are in results/
        self.handle_job_success(job, a.queue, job.started_job_registry, a.execution)
        publisher.close(self.connection, job.id, "succeeded", self.settings.result_ttl, **counts)
        log.info("job %s: succeeded (%s)", job.id, counts)

    def fail(self, a: Active, exc_string: str, retry: bool = True, abort: bool = True) -> None:
        """Abort the job's requests and fail this attempt (rq retries it if it has retries
        left and `retry`)."""
        if abort:
            self.engine.abort(a.job.id)
        self._done(a)
        self.fail_now(a.job, a.queue, a.execution, exc_string, retry)

    def fail_now(self, job: Job, queue: Queue, execution: Execution, exc_string: str,
                 retry: bool = False) -> None:
        job.ended_at = now()
        if not retry:
            job.retries_left = 0
        message = exc_string.strip().splitlines()[-1]
        self.connection.hset(keys.info(job.id), "error", message)
        self.handle_job_failure(job, queue, job.started_job_registry, exc_string, execution)
        if job.get_status(refresh=False) == JobStatus.FAILED:
            publisher.close(self.connection, job.id, "failed", self.settings.result_ttl,
                            error=message, **self._counts(job.id))
            log.warning("job %s: failed: %s", job.id, message)
        else:
            batch = Batch(self.connection)
            batch.status(job.id, "queued", error=message)
            batch.send()
            log.warning("job %s: attempt failed, retrying: %s", job.id, message)
        if not self.active:
            self.set_state(WorkerStatus.IDLE)

    def cancel(self, a: Active) -> None:
        """Abort now (KV freed at once); finished samples stay stored."""
        n = self.engine.abort(a.job.id)
        self._done(a)
        job = a.job
        with self.connection.pipeline() as pipe:
            job.set_status(JobStatus.CANCELED, pipeline=pipe)
            pipe.hset(job.key, "ended_at", utcformat(now()))
            self.cleanup_execution(job, pipeline=pipe, execution=a.execution)
            CanceledJobRegistry(job.origin, self.connection, serializer=self.serializer).add(job, pipeline=pipe)
            job.cleanup(self.settings.result_ttl, pipeline=pipe, remove_from_queue=False)
            pipe.execute()
        publisher.close(self.connection, job.id, "canceled", self.settings.result_ttl, **self._counts(job.id))
        log.info("job %s: canceled, %d requests aborted", job.id, n)

    def hand_back(self, a: Active) -> None:
        """Shutdown: requeue the job at the front, as if never started (no retry used)."""
        self.engine.abort(a.job.id)
        self._done(a)
        job = a.job
        with self.connection.pipeline() as pipe:
            pipe.multi()
            self.cleanup_execution(job, pipeline=pipe, execution=a.execution)
            job.started_at = None
            a.queue.enqueue_job(job, pipeline=pipe, at_front=True)
            pipe.xadd(keys.stream(job.id), events.status("queued", error="worker shut down; job handed back"))
            pipe.execute()
        log.info("job %s: handed back to queue %s", job.id, a.queue.name)
