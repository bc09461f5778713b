"""One engine step's events -> one Redis transaction for every shard in the step, or for
several steps when nobody follows their streams.

Invariants: a finished sample is stored (and counted in its job's progress) in the same
transaction that announces it, before the entry (results/publisher.py); a sample an
earlier attempt stored is neither stored nor announced again; after its first tokens, a
sample's deltas go out together at most every `interval` seconds (one entry per sample per
flush), and only while an API process follows the job's stream (keys.followed, read with
each send): a job nobody follows (a batch) gets each sample's final alone, its delta the
whole text, so rebuilding a stream from its deltas stays right, and Redis does a fraction
of the work.

When to send: every step while a running job is followed (its first tokens and finals go
out at once), a shard has finished all its samples (it ends, after them) or the engine has
room (a queued shard may join at once), or a message on the queues' wake channel came (a
new job was queued, or a cancel asked: keys.wake, read by rq's listener thread, so looking
costs no round trip); otherwise (a full engine of batches) a step's writes are carried
(Attempts.carry) and go with a later step's, at most `interval` seconds after the last
send: a GPU stepping 30 times a second then makes one round trip to Redis every 3 steps,
not every step, and Redis's cost per sample is mostly round trips (docs/benchmarks.md).
Every end of an attempt sends the carried writes first (attempts.py).

The same round trip reads the running shards' cancel flags, their jobs' followed flags
and the queue lengths (or, when only a new job's shard may join a full engine, the
queues' first PEEK shard ids): a new job's shard that may join the full engine beside the
others (Engine.has_room_for_owner) is taken, and a cancel acts, at the step after its
wake (other queued shards within `interval`); then the finished shards end and the
flagged ones are canceled.

`Publisher` owns the send timer; it reads the engine's room and the queues (member.py),
and through `Attempts` (attempts.py) records, sends, heartbeats and ends the attempts.
"""
from __future__ import annotations

import time

from results import keys, store

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
    def __init__(self, engine, attempts: Attempts, member: Member, link: Link, interval: float):
        self.engine = engine
        self.attempts = attempts
        self.member = member
        self.link = link
        # After its first tokens, a sample's deltas are sent together at most every
        # `interval` seconds (one stream entry per sample per flush, not per token), and
        # an unfollowed step's writes at most that late (the module's docstring).
        self.interval = interval
        self._next_send = 0.0
        self._wakes = 0  # member.wakes at the last look

    def publish(self, events: list) -> tuple[bool, list[list[bytes]] | None]:
        """One step's events -> the carried writes (Attempts.carry); when due, one Redis
        transaction with them, which also reads the cancel flags and the queues; then finish
        the completed shards and cancel the flagged ones. Returns whether shards are queued
        (False when nothing was sent), and when the engine has room only for a new job's
        shard (Engine.has_room_for_owner) the first shard ids of each queue."""
        at, active = self.attempts, self.attempts.active
        if self.member.beat_due(time.monotonic()):  # after a long step: are the shards still ours?
            self.link.retrying(at.heartbeat)
        batch = at.carry
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
        t, wakes = time.monotonic(), self.member.wakes
        due = t >= self._next_send or wakes != self._wakes  # woken: a new job queued, or a cancel
        self._wakes = wakes
        if due:
            self._next_send = t + self.interval
            for a in active.values():
                if not a.followed:
                    continue  # nobody reads its stream now: its samples' text goes with their finals
                for (index, sample), (text, ids, lps) in a.pending.items():
                    a.streaming.add((index, sample))
                    batch.delta(a.job_id, index, sample, text, ids, lps, a.custom_id(index))
                a.pending.clear()
        finished = any(active[tag].remaining == 0 for tag in in_step)
        room = self.engine.has_room()  # a queued shard may join now: read the queues
        if not (due or finished or room or any(a.followed for a in active.values())):
            return False, None  # carried: sent with a later step's writes
        tags = list(active)
        if tags:
            batch.read("mget", [keys.cancel(active[t].job_id) for t in tags])
            batch.read("mget", [keys.followed(keys.stream(active[t].job_id)) for t in tags])
        peek = not room and self.engine.has_room_for_owner()
        for q in self.member.queues:
            if peek:
                batch.read("lrange", q.key, 0, PEEK - 1)
            else:
                batch.read("llen", q.key)
        answers = at.flush()
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
