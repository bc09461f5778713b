"""The worker process: one engine, loaded once, fed by the shards of many jobs at a time.

rq's fork-per-job execution does not fit a GPU that must batch requests from several
jobs, so `Consumer` registers as an rq worker (member.py) but runs its own loop:

    tick   heartbeats (worker, its model's entry in the served models, and each running
           shard's execution, which also tells whether a shard was reaped meanwhile),
           reaping (shards whose worker died: reaper.py), run_at scheduling, rq's registry
           maintenance, timeouts, the drain's deadline
    admit  while the engine has room: take a shard (high, normal, low priority), claim it
           (jobs/shards.py), read its slice of the job's items and add the unfinished ones
           to the engine under the attempt's tag (the job is their owner: the engine shares
           its slots fairly between jobs); a full engine still takes a shard of a job it
           runs nothing of (admission.py)
    step   one engine step; its events for all shards go to Redis in one transaction
           (publish.py), which also reads the cancel flags and the queue lengths: one round
           trip per step, or per delta interval when nobody follows the running jobs'
           streams (the steps between are carried). A shard whose samples are all done
           ends, and the job with it if it was the last

The parts, each an object that owns its state, wired here and nowhere else:

    drain      Drain       the shutdown the signals asked for (drain.py)
    member     Member      this process as an rq worker: registration, heartbeats, the
                           model's entry, rq's scheduler and maintenance (member.py)
    link       Link        Redis across outages: retries, the exactly-once send (outage.py)
    attempts   Attempts    the attempts of shards running here, from claim to end
                           (attempts.py)
    admission  Admission   taking shards (admission.py)
    publisher  Publisher   a step's events to Redis (publish.py)
    reaper     Reaper      dead workers' shards (reaper.py)

SIGTERM (or SIGINT): stop taking shards, let running ones finish for `drain_timeout`
seconds, then hand the rest back (requeued at the front); a second signal hands back at
once. A handed-back or retried shard resumes: samples already stored are not recomputed,
and the rest are regenerated with the same seed.
"""
from __future__ import annotations

import logging
import signal
import time
import traceback

from rq.worker import WorkerStatus

from jobs.settings import Settings
from jobs.spec import queues as model_queues
from jobs.unavailable import REDIS_DOWN

from .admission import Admission
from .attempts import Attempts
from .drain import Drain
from .engine import Engine, EngineError
from .member import Member
from .metrics import WorkerMetrics
from .outage import Link, no_retries
from .publish import Publisher
from .reaper import Reaper

log = logging.getLogger("fanout.worker")


def fanout_job(spec: dict) -> None:  # noqa: ARG001
    """The function every Fanout rq job names. Its spec runs inside `fanout worker`."""
    raise RuntimeError("Fanout jobs run in `fanout worker`, which batches them in its engine; "
                       "a plain `rq worker` cannot run them")


class Consumer:
    def __init__(self, engine: Engine, connection, settings: Settings, queues=None,
                 name: str | None = None, drain_timeout: float = 30.0, delta_interval: float = 0.1,
                 model: str = "model"):
        no_retries(connection)  # before Member: rq's scheduler copies the connection's settings
        self.engine = engine
        self.drain = Drain(drain_timeout)
        self.member = Member(queues or model_queues(model), connection, settings, engine, model, name=name)
        self.name = self.member.name
        self.metrics = WorkerMetrics(self.name)
        self.link = Link(connection, self.name, self.metrics, self.drain, on_back=self.member.beat_soon,
                         on_lost=lambda: self.attempts.drop_all(), on_abandon=lambda: self.attempts.abandon())
        self.attempts = Attempts(engine, self.member, self.link, settings, self.metrics)
        self.admission = Admission(engine, self.member, self.link, self.attempts)
        self.publisher = Publisher(engine, self.attempts, self.member, self.link, delta_interval)
        self.reaper = Reaper(self.member, self.link, settings, self.metrics)
        self.metrics.watch(engine, self.attempts)

    def run(self, burst: bool = False) -> None:
        """Work until SIGTERM / SIGINT (or, with burst, until the queues are empty)."""
        link, attempts = self.link, self.attempts
        self.member.bootstrap()
        link.retrying(self.member.share_tokenizer)
        link.retrying(attempts.heartbeat)  # the model is listed before this worker says it is ready
        self.member.set_state(WorkerStatus.IDLE)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        try:
            while True:
                ready = link.guard(self.ready, burst)
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
                              extra={"job_ids": list(attempts.active)})
                    attempts.fail_all(exc)
                    raise
                self.metrics.step_seconds.observe(time.perf_counter() - t)
                queued, heads = self.publisher.publish(events)
                if queued and not self.drain.requested:  # shards are waiting: join them to the batch
                    if heads is None:
                        link.guard(self.admission.admit, False)
                    else:
                        link.guard(self.admission.admit_new_job, heads)
        finally:
            attempts.hand_back_all()
            try:
                self.member.leave()
            except REDIS_DOWN as e:
                log.warning("redis unavailable at exit (%s): this worker's registration expires by itself", e)

    def ready(self, burst: bool) -> bool | None:
        """Housekeeping, and jobs if the engine is idle. True: step the engine; False: stop;
        None: come again."""
        self.tick()
        if self.drain.requested and not self.attempts.active:
            return False
        if not self.engine.has_work():  # idle: wait (1 s at most) for a job
            if not self.drain.requested:
                self.admission.admit(block=not burst)
            if not self.engine.has_work():
                return False if burst and not self.attempts.active else None
        return True

    def _on_signal(self, signum, frame):
        # Only flags here: the loop acts on them between engine steps.
        running = len(self.attempts.active)
        if self.drain.request():
            log.info("warm shutdown: no new jobs; %d running get %.0fs to finish", running, self.drain.timeout)
        else:
            log.warning("second signal: handing back %d running jobs now", running)

    def tick(self) -> None:
        t = time.monotonic()
        if self.member.beat_due(t):
            self.attempts.heartbeat()
        if self.reaper.due(t):
            self.reaper.reap()
        self.member.schedule(t)  # move due run_at jobs (and retries) to their queues
        if self.member.should_run_maintenance_tasks:
            self.reaper.reap()  # an expired execution is the reaper's before rq's cleanup sees it
            self.member.run_maintenance_tasks()
        self.attempts.time_out(t)
        if self.drain.due(t):
            self.attempts.hand_back_all()
