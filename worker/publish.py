"""One engine step's events -> one Redis transaction for every shard in the step.

Invariants: a finished sample is stored (and counted in its job's progress) in the same
transaction that announces it, before the entry (results/publisher.py); a sample an
earlier attempt stored is neither stored nor announced again; after its first tokens, a
sample's deltas go out together at most every `delta_interval` seconds (one entry per
sample per flush), and only while an API process follows the job's stream (keys.followed,
read a step late): a job nobody follows (a batch) gets each sample's final alone, its delta
the whole text, so rebuilding a stream from its deltas stays right, and Redis does a
fraction of the work. The same round trip reads the running shards' cancel flags, their
jobs' followed flags and the queue lengths (or, when only a new job's shard may join a
full engine, the queues' first PEEK shard ids); then the finished shards end and the
flagged ones are canceled.

`Publisher` owns the flush timer; it reads the engine's room and the queues (member.py),
and through `Attempts` (attempts.py) records, sends, heartbeats and ends the attempts.
"""
from __future__ import annotations

import time

from results import keys, store
from results.publisher import Batch

from .attempts import Attempts
from .member import Member
from .outage import Link

PEEK = 64  # shard ids looked at per queue for a job the engine runs nothing of (8 jobs' windows)


def sample_record(ev) -> dict:
    """The stored record (results.store.sample_record) of a finished sample's final event."""
    usage = None
    if ev.usage is not None:
        usage = {"prompt_tokens": ev.usage.prompt_tokens, "cached_tokens": ev.usage.cached_tokens,
                 "completion_tokens": ev.usage.completion_tokens}
    stop = ev.matched_stop if isinstance(ev.matched_stop, str) else None  # a stop string, not a token
    return store.sample_record(ev.text or "", ev.token_ids or [], ev.finish_reason, usage, ev.error,
                               ev.logprobs, prompt_logprobs=ev.prompt_logprobs,
                               tool_calls=ev.tool_calls, content=ev.content, stop=stop,
                               embedding=ev.embedding)


class Publisher:
    def __init__(self, engine, attempts: Attempts, member: Member, link: Link, delta_interval: float):
        self.engine = engine
        self.attempts = attempts
        self.member = member
        self.link = link
        # After its first tokens, a sample's deltas are sent together at most every
        # delta_interval seconds: one stream entry per sample per flush, not per token.
        self.delta_interval = delta_interval
        self._next_flush = 0.0

    def publish(self, events: list) -> tuple[bool, list[list[bytes]] | None]:
        """One step's events -> one Redis transaction, which also reads the cancel flags and
        the queues; then finish the completed shards and cancel the flagged ones. Returns
        whether shards are queued, and when the engine has room only for a new job's shard
        (Engine.has_room_for_owner) the first shard ids of each queue."""
        at, active = self.attempts, self.attempts.active
        if self.member.beat_due(time.monotonic()):  # after a long step: are the shards still ours?
            self.link.retrying(at.heartbeat)
        batch = Batch(self.link.connection)
        in_step = {ev.tag for ev in events if ev.tag in active}
        jobs_in_step = {active[t].job_id for t in in_step}
        for job_id in jobs_in_step:
            batch.counts[job_id]["steps"] += 1
        for tag in in_step:
            a = active[tag]
            if len(jobs_in_step) > a.max_batch_jobs:
                a.max_batch_jobs = len(jobs_in_step)
                batch.at_least(a.job_id, "max_batch_jobs", a.max_batch_jobs)
        for ev in events:
            a = active.get(ev.tag)
            if a is None or (ev.index, ev.sample) in a.claim.stored:
                continue  # a canceled / handed-back shard, or a sample stored by an earlier attempt
            key = (ev.index, ev.sample)
            text, ids, lps = a.pending.pop(key, ("", [], None))
            text, ids = text + ev.text_delta, ids + ev.token_ids_delta
            if ev.logprobs_delta is not None:
                lps = (lps or []) + ev.logprobs_delta
            if not ev.finished:
                if a.followed and key not in a.streaming:  # a sample's first tokens go out at once
                    a.streaming.add(key)
                    batch.delta(a.job_id, ev.index, ev.sample, text, ids, lps, a.custom_id(ev.index))
                elif text or ids:
                    a.pending[key] = (text, ids, lps)
                continue
            at.record(batch, a, ev.index, ev.sample, sample_record(ev), text, ids)
        t = time.monotonic()
        if t >= self._next_flush:
            self._next_flush = t + self.delta_interval
            for a in active.values():
                if not a.followed:
                    continue  # nobody reads its stream now: its samples' text goes with their finals
                for (index, sample), (text, ids, lps) in a.pending.items():
                    a.streaming.add((index, sample))
                    batch.delta(a.job_id, index, sample, text, ids, lps, a.custom_id(index))
                a.pending.clear()
        tags = list(active)
        if tags:
            batch.read("mget", [keys.cancel(active[t].job_id) for t in tags])
            batch.read("mget", [keys.followed(keys.stream(active[t].job_id)) for t in tags])
        peek = not self.engine.has_room() and self.engine.has_room_for_owner()
        for q in self.member.queues:
            if peek:
                batch.read("lrange", q.key, 0, PEEK - 1)
            else:
                batch.read("llen", q.key)
        answers = at.send(batch)
        if answers is None:
            return False, None
        for tag in in_step:
            a = active.get(tag)
            if a is not None and a.remaining == 0:
                at.succeed(a)
        if tags:
            for tag, followed in zip(tags, answers[1]):
                if tag in active:
                    active[tag].followed = followed is not None
            for tag, flag in zip(tags, answers[0]):
                if flag is not None and tag in active:
                    at.cancel(active[tag])
        queues = answers[-len(self.member.queues):]
        return any(queues), queues if peek else None
