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

`carry` holds the writes of engine steps not sent yet (publish.py sends a step's writes
together with the next ones when nobody follows the stream): every end sends it first, so
a shard never ends before its samples are stored; an attempt dropped here (reaped: it runs
elsewhere now) takes the carried writes with it, and the other attempts in them are handed
back, as after an outage (`send`).

`Attempts` owns `active`. Invariant: `active` holds exactly the attempts this worker has
claimed and not ended, each with its requests in the engine under its tag, and rq's
`executions` of the worker (member.py) the same attempts' executions; every request of an
attempt leaves the engine (done, aborted) before the attempt ends.

It uses the engine (add, abort), the worker's rq membership (member.py: its name, TTL,
state and heartbeats), the Redis link (outage.py: retries, the exactly-once send) and the
blob store; the loop (consumer.py), admission (admission.py) and publishing (publish.py)
drive it.
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

from jobs import shards
from jobs.logs import JobLog
from jobs.settings import Settings
from jobs.spec import Shard
from results import blobs, keys, progress, store
from results.publisher import Batch

from .member import Member
from .metrics import WorkerMetrics
from .outage import Link

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
    followed: bool = False  # someone follows the job's stream (keys.followed): its deltas are sent
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
    def __init__(self, engine, member: Member, link: Link, settings: Settings, metrics: WorkerMetrics):
        self.engine = engine
        self.member = member
        self.link = link
        self.connection = link.connection
        self.settings = settings
        self.metrics = metrics
        self.blobs = blobs.open_store(settings.storage_url)  # the items of jobs that keep them there
        self.active: dict[str, Active] = {}
        self.carry = Batch(self.connection)  # writes of engine steps not sent yet (publish.py)

    def start(self, job: Job, queue: Queue) -> None:
        m = self.member
        c = shards.claim(self.connection, job, queue, m.name, m.heartbeat_ttl, m.busy, self.link.wait_for_redis)
        if c is None:
            JobLog(log, job.id).info("not queued any more, or its job ended; skipped")
            return
        m.executions[c.execution.id] = c.execution
        a = Active(c, left={}, remaining=0,
                   deadline=time.monotonic() + (job.timeout if job.timeout and job.timeout > 0 else 1e12))
        self.active[a.tag] = a
        try:
            spec = self.link.retrying(self.read_shard, c)
        except blobs.StoreError as e:  # away, or denying: held, no strike, until it answers again
            self.hold(a, f"{e} (the shard waits, tried again every {self.settings.shard_hold} s)")
            return
        except Exception as e:  # not a job our API made (or made by another version): no retry
            self.fail(a, f"bad job payload: {_one_line(e)}", retry=False, abort=False)
            return
        a.custom_ids = spec.custom_ids
        task = spec.task
        if task != self.engine.task:  # queues are per model (jobs/spec.py): only a meddled-with job
            self.fail(a, f"a {task} job's shard reached a worker that runs {self.engine.task} jobs",
                      retry=False, abort=False)
            return
        # A LoRA adapter's job comes through its base's queues (jobs/models.py).
        lora = c.info.get("model")
        lora = None if lora in (None, m.model) else lora
        if lora is not None and lora not in self.engine.adapters():
            self.fail(a, f"worker {self.member.name} serves {m.model} without the LoRA adapter {lora!r} "
                         "(every worker of a model should serve the same adapters)", abort=False)
            return
        JobLog(log, c.job_id).info("shard %d (items %d-%d), attempt %d, %d samples stored before",
                                   c.k, c.lo, c.hi - 1, c.attempt, len(c.stored))
        batch = Batch(self.connection)
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
                params = todo_params if task == "generate" else spec.embed
                self.engine.add(a.tag, todo, params, seed=spec.seed, owner=c.job_id,
                                **({"lora": lora} if lora is not None else {}))
            except ValueError as e:  # the job's input: retrying cannot help
                self.fail(a, f"ValueError: {e}", retry=False)
                return
            except Exception:
                self.fail(a, traceback.format_exc())
                return
        if a.remaining == 0:
            self.succeed(a)

    def record(self, batch: Batch, a: Active, index: int, sample: int, rec: dict,
               text_delta: str = "", ids_delta: list[int] | None = None) -> None:
        """Store and announce one finished sample (in `batch`, which the caller sends)."""
        a.left[index] -= 1
        a.remaining -= 1
        a.stored += 1
        if rec["finish_reason"] == "error":
            a.failed_items.add(index)
        self.metrics.sample(rec["finish_reason"], rec["usage"])
        batch.final(a.job_id, index, sample, text_delta, ids_delta or [], rec,
                    item_done=a.left[index] == 0, item_failed=index in a.failed_items,
                    custom_id=a.custom_id(index))

    def send(self, batch: Batch) -> list | None:
        """`batch` sent exactly once (Link.send). After an outage that outlasted the TTL, the
        heartbeat drops the attempts reaped meanwhile; if one of those this batch was
        written for is gone, the others in it are handed back (they resume from what Redis
        stored) and the batch is dropped: None."""
        holding = list(self.active)

        def still_ours() -> bool:
            self.link.retrying(self.heartbeat)
            if all(tag in self.active for tag in holding):
                return True
            for a in [a for a in self.active.values() if a.job_id in batch.jobs]:
                self.hand_back(a, "redis was unavailable for too long; shard handed back")
            return False

        return self.link.send(batch, still_ours)

    def flush(self) -> list | None:
        """Send the carried writes (and the reads the publisher queued on them): their
        answers, or None when the batch was dropped (Attempts.send)."""
        batch, self.carry = self.carry, Batch(self.connection)
        return self.send(batch)

    def _discard_carry(self) -> None:
        self.carry = Batch(self.connection)

    def heartbeat(self) -> None:
        """Heartbeat the worker and every running attempt (Member.beat); an attempt whose
        execution was reaped meanwhile runs elsewhere now, and is dropped here."""
        for a in self.member.beat(list(self.active.values())):
            if a.tag in self.active:
                JobLog(log, a.job_id).warning("shard %d reaped while this worker could not heartbeat it; "
                                              "dropped here", a.claim.k)
                self.drop(a)

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
        return Shard.read(c.info["kind"], int(c.info["seed"]), c.info.get("params"), entries, custom, c.lo,
                          c.info.get("task") or "generate", c.info.get("embed"))

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
        self.member.executions.pop(a.claim.execution.id, None)
        if not self.active:
            self.link.retrying(self.member.set_state, WorkerStatus.IDLE)

    def _settle(self, a: Active, outcome: str, error: str | None = None, on_pipe=None) -> str | None:
        """End this attempt of the shard in Redis (jobs/shards.py), once, across outages.
        A job that keeps its items in the blob store has its stream trimmed as shards end."""
        if a.job_id in self.carry.jobs:  # its samples stored before it ends
            self.flush()
        c = a.claim
        return shards.settle(self.connection, c.job_id, c.k, c.job, c.execution, outcome,
                             self.settings.result_ttl, self.link.wait_for_redis, error=error,
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
            return self.link.retrying(store.keep, self.connection, self.blobs, c.job_id,
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
            self.link.retrying(shards.drop_queued, self.connection, a.job_id)
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
            self.link.retrying(shards.drop_queued, self.connection, a.job_id)
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
        """Forget a job here without writing anything for it: the carried writes go too if
        they hold some of its (the attempts they also hold are handed back)."""
        self.engine.abort(a.tag)
        self._done(a)
        self.metrics.attempt("dropped")
        if a.job_id in self.carry.jobs:
            jobs = self.carry.jobs
            self._discard_carry()
            for b in [b for b in self.active.values() if b.job_id in jobs]:
                self.hand_back(b, "a shard of its job was reaped here; handed back with it")

    def time_out(self, t: float) -> None:
        """Fail the attempts past their job's timeout at monotonic time `t` (retried while
        strikes are left)."""
        for a in [a for a in self.active.values() if t > a.deadline]:
            self.fail(a, f"JobTimeoutException: shard exceeded its timeout of {a.claim.job.timeout}s")

    def fail_all(self, exc_string: str) -> None:
        """The engine failed with no request to blame: every attempt fails (retried if it has
        retries left), its requests gone with the engine's state."""
        for a in list(self.active.values()):
            self.fail(a, exc_string, abort=False)

    def hand_back_all(self) -> None:
        for a in list(self.active.values()):
            self.hand_back(a)

    def drop_all(self) -> None:
        """Redis came back without writes it had acknowledged (Link's on_lost): the running
        attempts resume from what Redis kept once their executions expire."""
        if self.active:
            log.error("redis came back without writes it had acknowledged: dropping %d running jobs; "
                      "they resume from what redis kept once their heartbeat expires", len(self.active))
        self._discard_carry()
        for a in list(self.active.values()):
            self.drop(a)

    def abandon(self) -> None:
        """Redis is away past the drain's deadline (Link's on_abandon): no hand-back without
        Redis, so the requests leave the engine and nothing is written; the shards are
        retried elsewhere once their executions expire."""
        self._discard_carry()
        for a in list(self.active.values()):
            self.engine.abort(a.tag)
            self.member.executions.pop(a.claim.execution.id, None)
        self.active.clear()
