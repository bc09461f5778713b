"""Redis outages, as the worker rides them out: the loop pauses (the engine keeps its
state: nothing leaves the worker but through Redis) and tries again with backoff.

Invariants: a write that must apply once is sent again only after checking it did not
apply (the step transaction by a marker key written with it: `send`; a shard's claim and
settle by its entry in the job's running-shards hash: jobs/shards.py); housekeeping that
may run twice goes through `guard` or `retrying`. Once Redis is back, the first heartbeat
drops the shards that were reaped meanwhile (an outage longer than the TTL): they run
elsewhere. If Redis came back without writes it had acknowledged, the running shards are
dropped and resume from what it kept.

`Outages` is part of the worker (worker/consumer.py): it uses its `connection`,
`active` shards, `metrics`, `beat`, `drop`, `hand_back`, the shutdown flags, and the marker
state set in its __init__.
"""
from __future__ import annotations

import logging
import time

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq.utils import as_text

from results.publisher import Batch

log = logging.getLogger("fanout.worker")

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError)
MAX_BACKOFF = 5.0  # seconds between tries while Redis is away


class Outages:
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
