"""This process as a member of the fleet: an rq worker (registration, state, its heartbeat
with its model and tokens/s for GET /v1/fleet, rq's registry maintenance and scheduler of
delayed jobs) that also heartbeats the executions of the shards it runs and its model's entry
among the served models (jobs/models.py: GET /v1/models, and the API's checks of a request's
model, images and tools).
It takes shards from its model's queues alone (jobs.spec.queues).

rq's `BaseWorker` lives here alone: the Fanout worker uses its registration and
bookkeeping but not its fork-per-job loop (`execute_job` refuses), so the rest of the
worker never touches rq's worker state but through this object.

Invariant: the heartbeat TTL is the one every execution of this worker gets (rq's own
starts at 90 s, which made a dead worker's shards wait minutes); beats come every third of
it, and at once after an outage (`beat_soon`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time

from rq import Queue, worker_registration
from rq.job import Job
from rq.scheduler import RQScheduler
from rq.serializers import JSONSerializer
from rq.utils import now
from rq.worker import BaseWorker, WorkerStatus

from jobs import models
from jobs.settings import Settings
from jobs.unavailable import REDIS_DOWN
from results import keys

log = logging.getLogger("fanout.worker")
LISTEN_S = 1.0  # the longest read of rq's command listener: how long a shutdown may wait for it


class Member(BaseWorker):
    def __init__(self, queues, connection, settings: Settings, engine, model: str, name: str | None = None):
        super().__init__(queues, name=name, connection=connection, serializer=JSONSerializer,
                         default_result_ttl=settings.result_ttl)
        self.engine = engine  # read for the model's entry and its tokenizer files
        self.model = model  # the name it serves under: GET /v1/models, a request's `model`, job status
        self._model_since = int(time.time())
        # Its task, the image URL schemes its chats take ([] for a text model), its context,
        # its tool format: the API's checks of a request (api/openai/models.py).
        self.served = engine.served()
        self.heartbeat_ttl = settings.heartbeat_ttl
        self.heartbeat_s = settings.heartbeat_ttl / 3
        self._next_beat = 0.0
        self._counted: tuple[float, int, int] | None = None  # (when, prefill, decode tokens) at the last beat
        self.wakes = 0  # messages on its queues' wake channels (keys.wake), counted by rq's listener thread
        self.delayed = RQScheduler(self.queues, connection, serializer=JSONSerializer)
        self._next_schedule = 0.0

    def execute_job(self, job: Job, queue: Queue):
        raise NotImplementedError("the Fanout worker batches jobs in its run loop, not one at a time")

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # rq's (90 s and more) made a dead worker's job wait minutes; our heartbeats are frequent.
        return self.heartbeat_ttl

    def _pubsub_exception_handler(self, exc, pubsub, pubsub_thread) -> None:
        # rq logs an error every 2 s while Redis is away; the loop already says so, less often.
        if isinstance(exc, REDIS_DOWN):
            time.sleep(2.0)
            return
        super()._pubsub_exception_handler(exc, pubsub, pubsub_thread)

    def subscribe(self) -> None:
        """rq's, also on its queues' wake channels (keys.wake), with its listener thread
        waking every second, not every 60. redis-py's PubSubWorkerThread.stop() (8.x) waits
        for the thread, which reads its stop flag only between reads: when the unsubscribe's
        reply came before the flag was cleared (the loop descheduled a moment, as under
        load), a shutdown waited up to a minute, past a pod's grace period and the tests' 30 s."""
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        channels = {keys.wake(q.name): self._on_wake for q in self.queues}
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload, **channels})
        self.pubsub_thread = self.pubsub.run_in_thread(sleep_time=LISTEN_S, daemon=True,
                                                       exception_handler=self._pubsub_exception_handler)

    def _on_wake(self, message) -> None:
        # The listener thread counts; the loop compares (publish.py): one writer, no lock.
        self.wakes += 1

    def busy(self, pipe) -> None:
        """A claim's writes of the worker's own (in the claim's transaction)."""
        self.set_state(WorkerStatus.BUSY, pipeline=pipe)
        self.heartbeat(pipeline=pipe)

    def share_tokenizer(self) -> None:
        """The model's tokenizer files in Redis (keys.tokenizer), for the API's /tokenize: the
        API never reads a model's files. Written in one transaction, with their digest."""
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

    def beat_due(self, t: float) -> bool:
        return t >= self._next_beat

    def beat_soon(self) -> None:
        """Beat at the next chance: after an outage, or a step that outlasted the interval."""
        self._next_beat = 0.0

    def beat(self, running: list) -> list:
        """Heartbeat the worker, the executions of `running` (attempts.Active) and the model's
        entry, in one transaction that first reads whether each execution is still
        registered. Returns those that are not: reaped (this worker stalled, or Redis was
        away, longer than the TTL), so their shards run elsewhere now."""
        self._next_beat = time.monotonic() + self.heartbeat_s
        with self.connection.pipeline() as pipe:
            for a in running:
                pipe.zscore(a.claim.job.started_job_registry.key, a.claim.execution.composite_key)
            self.heartbeat(pipeline=pipe)
            for a in running:
                a.claim.execution.heartbeat(a.claim.job.started_job_registry, self.heartbeat_ttl, pipeline=pipe)
            models.announce(pipe, self.model, self._model_since, self.heartbeat_ttl, self.served,
                            self.engine.adapters())
            pipe.hset(self.key, "fanout", json.dumps(self.figures()))
            answers = pipe.execute()
        if answers[len(running)] == 1:  # our worker key was new: Redis lost it, so register again
            with self.connection.pipeline() as pipe:
                pipe.hset(self.key, mapping=self.serialize())
                worker_registration.register(self, pipe)
                pipe.execute()
        return [a for a, score in zip(running, answers) if score is None]

    def figures(self) -> dict:
        """What GET /v1/fleet shows of this worker beside rq's fields (kept in its rq hash,
        field `fanout`): its model, and the tokens its engine ran per second since the last
        beat (a rate over the beat interval, like `rate()` of the worker's token counters,
        which need --metrics-port and a Prometheus)."""
        t, stats = time.monotonic(), self.engine.stats()
        now = (t, stats.prefill_tokens, stats.decode_tokens)
        last, self._counted = self._counted or now, now
        dt = t - last[0]
        prefill, decode = ((n - m) / dt if dt > 0 else 0.0 for n, m in zip(now[1:], last[1:]))
        return {"model": self.model, "prefill_tokens_per_s": round(prefill, 1),
                "decode_tokens_per_s": round(decode, 1)}

    def schedule(self, t: float) -> None:
        """Once a second, rq's scheduler: move due run_at jobs (held shards, retries) to their
        queues, from the worker that holds the scheduler's locks."""
        if t < self._next_schedule:
            return
        self._next_schedule = t + 1.0
        if self.delayed.should_reacquire_locks:
            self.delayed.acquire_locks()
        if self.delayed.acquired_locks:
            self.delayed.heartbeat()
            self.delayed.enqueue_scheduled_jobs()

    def clean_registries(self) -> None:
        """rq's maintenance of the queues' registries (at start, then every 10 minutes), but
        an expired execution in a StartedJobRegistry is the reaper's alone (the loop reaps
        just before: reaper.py). rq's own cleanup of it would mark the shard's rq job failed
        (AbandonedJobError) with no stream entry and no retry, and the job would hang: a
        worker that started as a dead worker's heartbeat expired once did that, between its
        reap and this maintenance (the scores are whole seconds)."""
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

    def leave(self) -> None:
        """At exit: the scheduler's locks released, the worker's registration removed."""
        if self.delayed.acquired_locks:
            self.delayed.release_locks()
        self.teardown()
