"""One engine step's events -> one Redis transaction for every shard in the step.

Invariants: a finished sample is stored (and counted in its job's progress) in the same
transaction that announces it, before the entry (results/publisher.py); a sample an
earlier attempt stored is neither stored nor announced again; after its first tokens, a
sample's deltas go out together at most every `delta_interval` seconds (one entry per
sample per flush). The same round trip reads the running shards' cancel flags and the
queue lengths (or, when only a new job's shard may join a full engine, the queues' first
PEEK shard ids); then the finished shards end and the flagged ones are canceled.

`Publishing` is part of the worker (worker/consumer.py): it uses its `active` shards,
`send`, `beat`, `succeed`, `cancel`, `metrics` and queues.
"""
from __future__ import annotations

import time

from results import keys, store
from results.publisher import Batch

from .attempts import Active

PEEK = 64  # shard ids looked at per queue for a job the engine runs nothing of (8 jobs' windows)


def sample_record(ev) -> dict:
    """The stored record (results.store.sample_record) of a finished sample's final event."""
    usage = None
    if ev.usage is not None:
        usage = {"prompt_tokens": ev.usage.prompt_tokens, "cached_tokens": ev.usage.cached_tokens,
                 "completion_tokens": ev.usage.completion_tokens}
    return store.sample_record(ev.text or "", ev.token_ids or [], ev.finish_reason, usage, ev.error,
                               ev.logprobs, prompt_logprobs=ev.prompt_logprobs,
                               tool_calls=ev.tool_calls, content=ev.content)


class Publishing:
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

    def publish(self, events: list) -> tuple[bool, list[list[bytes]] | None]:
        """One step's events -> one Redis transaction, which also reads the cancel flags and
        the queues; then finish the completed shards and cancel the flagged ones. Returns
        whether shards are queued, and when the engine has room only for a new job's shard
        (Engine.has_room_for_owner) the first shard ids of each queue."""
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
            self.record(batch, a, ev.index, ev.sample, sample_record(ev), text, ids)
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
        peek = not self.engine.has_room() and self.engine.has_room_for_owner()
        for q in self.queues:
            if peek:
                batch.read("lrange", q.key, 0, PEEK - 1)
            else:
                batch.read("llen", q.key)
        answers = self.send(batch)
        if answers is None:
            return False, None
        for tag in in_step:
            a = self.active.get(tag)
            if a is not None and a.remaining == 0:
                self.succeed(a)
        if tags:
            for tag, flag in zip(tags, answers[0]):
                if flag is not None and tag in self.active:
                    self.cancel(self.active[tag])
        queues = answers[-len(self.queues):]
        return any(queues), queues if peek else None
