"""Admission: the worker takes shards while its engine has room.

A shard is taken off its queue and recorded as being taken in one script (shards.take): a
worker that dies before its claim leaves it to the reapers, who queue it again. Idle, the
worker blocks up to 1 s on the queues (rq's BLPOP). A full engine still takes a shard of a
job it runs nothing of, from the head of the first queue that holds shards, so a small job
starts beside a huge one (the engine retracts some of the huge one's samples to give it its
share). Each shard taken starts an attempt (attempts.py).

`Admission` owns no state of its own: it reads the engine's room, the queues (member.py) and
which jobs run here (attempts.py).
"""
from __future__ import annotations

import time

from rq import Queue
from rq.exceptions import DequeueTimeout, NoSuchJobError
from rq.job import Job
from rq.utils import as_text

from jobs import shards
from jobs.unavailable import REDIS_DOWN

from .attempts import Attempts
from .member import Member
from .outage import Link


class Admission:
    def __init__(self, engine, member: Member, link: Link, attempts: Attempts):
        self.engine = engine
        self.member = member
        self.link = link
        self.attempts = attempts

    def admit(self, block: bool) -> None:
        """Take shards while the engine has room; wait up to 1 s for one when idle."""
        m = self.member
        while self.engine.has_room():
            got = shards.take(m.connection, m.queues, time.time())
            if got is None and block:
                got = self._wait_for_shard()
            if got is None:
                return
            block = False
            queue, sid = got
            try:
                job = Job.fetch(sid, connection=m.connection, serializer=m.serializer)
            except NoSuchJobError:  # its job ended and took it along
                shards.untake(m.connection, sid)
                continue
            self.attempts.start(job, queue)

    def _wait_for_shard(self) -> tuple[Queue, str] | None:
        """Idle: block up to 1 s for a shard on any queue (rq's BLPOP; the one pop that is
        recorded as taken only after it, a moment later)."""
        m = self.member
        try:
            got = Queue.dequeue_any(m.queues, 1, connection=m.connection, job_class=m.job_class,
                                    serializer=m.serializer)
        except DequeueTimeout:
            return None
        except REDIS_DOWN as e:
            if not (hasattr(e, "job_id") and len(m.queues) > 1):
                raise
            # Popped, then the connection broke before the job was read: put it back.
            self.link.retrying(self._unpop, e.queue, e.job_id)
            return None
        if got is None:
            return None
        job, queue = got
        shards.mark_taken(m.connection, queue, job.id, time.time())
        return queue, job.id

    def admit_new_job(self, heads: list[list[bytes]]) -> None:
        """A full engine: take the first shard in `heads` (the queues' first ids) of a job
        with nothing here, from the first queue (by priority) holding shards: a lower queue
        is looked at only when the higher ones are empty, so high still passes normal."""
        m = self.member
        mine = {a.job_id for a in self.attempts.active.values()}
        for queue, ids in zip(m.queues, heads):
            if not ids:
                continue
            for sid in map(as_text, ids):
                # Whoever takes the id out of the queue holds it (recorded as being taken).
                if shards.job_of(sid) not in mine and shards.take_id(m.connection, queue, sid, time.time()):
                    try:
                        job = Job.fetch(sid, connection=m.connection, serializer=m.serializer)
                    except NoSuchJobError:
                        shards.untake(m.connection, sid)
                        return
                    self.attempts.start(job, queue)  # (a lost reply: the reapers queue it again)
                    return
            return

    def _unpop(self, queue: Queue, job_id: str) -> None:
        if self.member.connection.lpos(queue.key, job_id) is None:
            self.member.connection.lpush(queue.key, job_id)
