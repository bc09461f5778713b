"""One attempt of a shard on this worker, from its claim to its end.

    start      claim the shard (jobs/shards.py), read its items, add the samples no earlier
               attempt stored to the engine under the attempt's tag (`Active.tag`)
    succeed    every sample stored: the shard is done, and its job with it if it was the last
    fail       aborted; retried (a strike, unless it stored samples) or its job fails
    cancel     the job's cancel flag: aborted, finished samples stay stored
    hold       what it needs (the blob store) is away: queued again later, no strike
    hand_back  the worker stops: queued again at the front, no strike
    drop       reaped while this worker could not heartbeat it: forgotten, nothing written

Each end is one transaction in Redis (shards.settle), applied once across outages.

Invariant: `active` holds exactly the attempts this worker has claimed and not ended, each
with its requests in the engine under its tag; every request of an attempt leaves the
engine (done, aborted) before the attempt ends.

`Attempts` is part of the worker (worker/consumer.py): it uses its engine, connection,
settings, metrics, `retrying` (worker/outage.py) and `record` (worker/publish.py).
"""
from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from rq.job import Job
from rq.queue import Queue
from rq.worker import WorkerStatus

from results import blobs, keys, progress, store
from results.publisher import Batch

from jobs import shards
from jobs.logs import JobLog
from jobs.spec import Shard

log = logging.getLogger("fanout.worker")


@dataclass(slots=True)
class Active:
    """An attempt of a shard whose requests are in the engine, under its own tag."""
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
        """The shard's rq job id and this attempt's number: the events of an attempt that was
        dropped here (reaped meanwhile) or aborted, still on their way out of the engine,
        never count for a later attempt of the same shard on this worker."""
        return f"{self.claim.job.id}#{self.claim.attempt}"

    @property
    def job_id(self) -> str:
        return self.claim.job_id

    def custom_id(self, index: int) -> str | None:
        return self.custom_ids[index - self.claim.lo] if self.custom_ids else None


def _one_line(e: Exception) -> str:
    """A parse error in one line: pydantic's errors as `loc: message; ...`."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        return "; ".join(f"{'.'.join(map(str, x['loc'])) or 'spec'}: {x['msg']}" for x in errors()[:5])
    return f"{type(e).__name__}: {e}"


class Attempts:
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
        self.active[a.tag] = a
        try:
            spec = self.retrying(self.read_shard, c)
        except blobs.StoreError as e:  # away, or denying: held, no strike, until it answers again
            self.hold(a, f"{e} (the shard waits, tried again every {self.settings.shard_hold} s)")
            return
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
        if a.tag not in self.active:  # dropped: Redis was away longer than the TTL
            return
        if todo:
            try:
                self.engine.add(a.tag, todo, todo_params, seed=spec.seed, owner=c.job_id)
            except ValueError as e:  # the job's input: retrying cannot help
                self.fail(a, f"ValueError: {e}", retry=False)
                return
            except Exception:
                self.fail(a, traceback.format_exc())
                return
        if a.remaining == 0:
            self.succeed(a)

    def read_shard(self, c: shards.Claim) -> Shard:
        """The shard's items from the job's item list, or from the blob store (one shard's
        worth, tens of KB: read here, on the loop, between steps)."""
        custom = self.connection.lrange(keys.custom_ids(c.job_id), c.lo, c.hi - 1)
        if c.info.get("items_in") != "store":
            entries = self.connection.lindex(keys.items(c.job_id), c.k)
        else:
            try:
                entries = b"".join(self.blobs.get(keys.items_blob(c.job_id, c.k)))
            except blobs.Missing:
                entries = None
        if entries is None:
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

    def _done(self, a: Active) -> None:
        del self.active[a.tag]
        self.executions.pop(a.claim.execution.id, None)
        if not self.active:
            self.retrying(self.set_state, WorkerStatus.IDLE)

    def _settle(self, a: Active, outcome: str, error: str | None = None, on_pipe=None) -> str | None:
        """End this attempt of the shard in Redis (jobs/shards.py), once, across outages.
        A job that keeps its items in the blob store has its stream trimmed as shards end."""
        c = a.claim
        return shards.settle(self.connection, c.job_id, c.k, c.job, c.execution, outcome,
                             self.settings.result_ttl, self.wait_for_redis, error=error,
                             progressed=a.stored > 0, on_pipe=on_pipe,
                             trim=c.info.get("items_in") == "store", hold=self.settings.shard_hold)

    def _keep(self, a: Active):
        """A job that keeps its items in the blob store keeps its done shards' results there
        too (results.store.keep): the settle's writes that move them, or None (a small job;
        or the store failing: they stay in Redis, where readers find them as well)."""
        c = a.claim
        if c.info.get("items_in") != "store":
            return None
        try:
            return self.retrying(store.keep, self.connection, self.blobs, c.job_id,
                                 progress.Ns.decode(c.info["ns"]), c.k, c.lo, c.hi, a.custom_ids)
        except blobs.StoreError as e:
            JobLog(log, c.job_id).warning("shard %d: results kept in Redis: %s", c.k, e)
            return None

    def succeed(self, a: Active) -> None:
        self._done(a)
        if self._settle(a, shards.DONE, on_pipe=self._keep(a)) is not None:
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

    def hold(self, a: Active, reason: str) -> None:
        """Queue the shard again settings.shard_hold seconds on, no strike: what it needs is away."""
        self._done(a)
        if self._settle(a, shards.HELD, reason) is not None:
            JobLog(log, a.job_id).warning("shard %d held for %d s: %s", a.claim.k, self.settings.shard_hold, reason)
            self.metrics.attempt("held")

    def hand_back(self, a: Active, reason: str = "worker shut down; shard handed back") -> None:
        """Requeue the shard at the front, as if never started (no strike)."""
        self.engine.abort(a.tag)
        self._done(a)
        if self._settle(a, shards.HANDED_BACK, reason) is not None:
            JobLog(log, a.job_id).info("shard %d handed back to queue %s", a.claim.k, a.claim.queue.name)
            self.metrics.attempt("handed_back")

    def drop(self, a: Active) -> None:
        """Forget a job here without writing anything for it."""
        self.engine.abort(a.tag)
        self._done(a)
        self.metrics.attempt("dropped")
