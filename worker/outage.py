"""Redis as the worker's loop reaches it, across outages: Redis away, or full and refusing
writes (jobs/unavailable.py). The loop pauses (the engine keeps its state: nothing leaves the
worker but through Redis) and tries again with backoff, until Redis takes a write again.

`Link` owns the connection's outage state: the marker key that every step transaction also
sets, and which transaction Redis last acknowledged. What it may do to the rest of the
worker is given to it as three hooks: `on_back` (Redis answers again: heartbeat at once),
`on_lost` (Redis came back without writes it had acknowledged: drop the running attempts)
and `on_abandon` (the drain's deadline passed while Redis was away: forget them and exit).

Invariants: a write that must apply once is sent again only after checking it did not
apply (the step transaction by the marker written with it: `send`; a shard's claim and
settle by its entry in the job's running-shards hash: jobs/shards.py); housekeeping that
may run twice goes through `guard` or `retrying`. Once Redis is back, the first heartbeat
drops the shards that were reaped meanwhile (an outage longer than the TTL): they run
elsewhere.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

from redis.backoff import NoBackoff
from redis.retry import Retry
from rq.utils import as_text

from jobs.unavailable import REDIS_DOWN, describe
from results.publisher import Batch

from .drain import Drain
from .metrics import WorkerMetrics

log = logging.getLogger("fanout.worker")

MAX_BACKOFF = 5.0  # seconds between tries while Redis is away


def no_retries(connection) -> None:
    """Connection errors come to the Link, which knows whether a write may be sent again;
    redis-py's own retries would send a transaction again whose reply was lost. Set before
    anything copies the connection's settings (rq's scheduler makes its own from them)."""
    connection.set_retry(Retry(NoBackoff(), 0))


class Link:
    def __init__(self, connection, worker: str, metrics: WorkerMetrics, drain: Drain,
                 on_back: Callable[[], None], on_lost: Callable[[], None], on_abandon: Callable[[], None]):
        self.connection = connection  # sends each command once: see no_retries
        self.metrics = metrics
        self.drain = drain
        self._on_back, self._on_lost, self._on_abandon = on_back, on_lost, on_abandon
        # Every step transaction also sets this key (this process's own) to a new value:
        # after a lost connection, reading it tells whether the transaction applied.
        self._marker = f"fanout:worker:{worker}:{os.urandom(4).hex()}:sent"
        self._sends = 0
        self._sent: str | None = None  # the marker of the last transaction Redis acknowledged
        self._sending: str | None = None  # the marker of the transaction in flight

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
            if self.drain.due(time.monotonic()):
                # No hand-back without Redis: the jobs are retried elsewhere once their
                # executions expire.
                self._on_abandon()
                raise SystemExit(f"fanout worker: redis unavailable at shutdown ({error}); running jobs "
                                 "are retried elsewhere once their heartbeat expires")
            log.warning("%s (%s): paused; next try in %.2fs", describe(error), error, delay)
            time.sleep(delay)
            try:
                seen = self.connection.get(self._marker)
                # Back means taking writes: a full Redis still answers reads.
                self.connection.set(self._marker + ":probe", 1, px=60_000)
                break
            except REDIS_DOWN as e:
                error, delay = e, min(delay * 2, MAX_BACKOFF)
        log.warning("redis is back after %.1fs; resuming", time.monotonic() - since)
        self.metrics.redis_outage_seconds.inc(time.monotonic() - since)
        self._on_back()
        seen = as_text(seen) if seen is not None else None
        if seen is not None and seen == self._sending:
            self._sent = seen  # the step transaction in flight applied; only its reply was lost
        elif seen != self._sent:
            self._sent = seen
            self._on_lost()

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

    def send(self, batch: Batch, still_ours: Callable[[], bool]) -> list | None:
        """Send `batch` exactly once, across Redis outages. Returns the answers of its reads,
        or None if it was dropped: after an outage that it did not outlive (Redis never
        applied it), `still_ours()` said that what it writes for is no longer this worker's,
        or Redis lost writes (see wait_for_redis)."""
        self._sends += 1
        self._sending = mark = str(self._sends)
        batch.pipe.set(self._marker, mark, ex=24 * 3600)
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
                if not still_ours():
                    return None
        finally:
            self._sending = None

    def _read(self, batch: Batch) -> list:
        with self.connection.pipeline(transaction=False) as pipe:
            for command, args in batch.reads:
                getattr(pipe, command)(*args)
            return pipe.execute()
