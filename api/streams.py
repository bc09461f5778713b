"""Following job streams: one Redis reader per API process for every follower (SSE relays,
streamed and waiting chats and completions).

A follower first reads what its stream already holds with short non-blocking XREADs on the
shared pool, then subscribes to the hub. The hub's one task blocks in one XREAD over every
followed stream, from each stream's earliest subscriber position, plus this process's wake
stream (a subscribe XADDs to it, so a new stream is read at once rather than after the
block), and hands each follower the entries past what it was given. So a thousand streams
cost one connection, not a thousand (redis-py's pool holds 100).

Memory is bounded: a follower's queue holds MAX_QUEUED batches; one that falls behind (a slow
client) leaves the hub and catches up on its own, as it started, losing nothing. Past
`FANOUT_MAX_STREAMS` followers a new one is refused (503, logged), never an empty stream.
Every REVOKE_CHECK seconds the hub looks up the API keys of its followers; the followers
of a revoked key end with `closed` set. While a stream has a follower here, its followed
flag (keys.followed) is set, at once and every keys.FOLLOWED_RENEW seconds with a TTL of
keys.FOLLOWED_TTL: a job's workers send its deltas only while it is (worker/publish.py), so a
batch nobody watches costs Redis its finals alone.
"""
from __future__ import annotations

import asyncio
import logging
import os
import weakref
from typing import Awaitable, Callable

import redis.asyncio as aioredis
import redis.exceptions

from jobs.redis_url import connect_async
from results import events, keys, reader

log = logging.getLogger("fanout.api")

COUNT = 1000  # entries per stream per read
BLOCK_MS = 5000  # the hub's XREAD block; a subscribe wakes it at once
MAX_QUEUED = 64  # batches a follower may have waiting; past them it reads on its own
REVOKE_CHECK = 2.0  # seconds between looks for revoked keys
READ_RETRIES = (0.2, 0.5, 1.0, 2.0)  # seconds before each new try of a failed catch-up read


CLOSED = "closed"  # the SSE event, and the entry type, of a follower the hub ended


def closing(f: "Follower") -> dict:
    """The last event of a follower the hub ended: why, and where to resume (as the key's
    owner, with another key: Last-Event-ID)."""
    return {"type": CLOSED, "reason": f.closed, "last_id": f.last}


def tenant_id(request) -> str | None:
    """The follower's tenant (None in open mode): its key is looked up while it follows."""
    tenant = request.state.tenant
    return tenant.id if tenant is not None else None


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else v


class TooManyStreams(Exception):
    def __init__(self, limit: int):
        super().__init__(f"this API process follows its limit of {limit} streams (FANOUT_MAX_STREAMS); "
                         "try again shortly, or another API process")
        self.limit = limit


class Follower:
    """One reader of one stream, from after `last`. next() gives its entries in order."""

    def __init__(self, hub: "Hub", key: str, last: str, tenant_id: str | None):
        self.hub, self.key, self.tenant_id = hub, key, tenant_id
        self.last = last  # the last entry handed to the caller
        self.given = last  # the last entry the hub queued (>= last)
        self.queue: asyncio.Queue = asyncio.Queue(MAX_QUEUED)
        self.subscribed = False
        self.closed: str | None = None  # why the hub ended it (its API key was revoked)

    async def next(self, timeout: float) -> list[tuple[str, dict]]:
        """The next entries (id, fields); [] after `timeout` seconds with none, or once closed."""
        if self.closed:
            return []
        if not self.subscribed and self.queue.empty():
            got = await self.read()
            if got:
                return self._take(got[0][1])
            self.given = self.last
            self.hub.subscribe(self)
        try:
            batch = self.queue.get_nowait()
        except asyncio.QueueEmpty:
            if self.closed:
                return []
            try:
                batch = await asyncio.wait_for(self.queue.get(), timeout)
            except asyncio.TimeoutError:
                return []
        return self._take(batch)

    async def read(self, count: int = COUNT):
        """XREAD of the stream after `last` (not moving it), tried again through a busy
        moment (a connection slow to open, a slow reply); only Redis staying away ends the
        follower (ConnectionError or TimeoutError: the caller ends its stream, the client
        resumes with Last-Event-ID)."""
        for delay in READ_RETRIES + (None,):
            try:
                return await self.hub.redis.xread({self.key: self.last}, count=count)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                if delay is None:
                    raise
                await asyncio.sleep(delay)

    def _take(self, entries) -> list[tuple[str, dict]]:
        out = [(_text(i), f) for i, f in entries]
        if out:
            self.last = out[-1][0]
        return out

    def close(self) -> None:
        self.hub.unsubscribe(self)


class Hub:
    def __init__(self, redis_url: str, redis: aioredis.Redis, limit: int,
                 revoked: Callable[[set[str]], Awaitable[set[str]]]):
        self.redis = redis  # the shared pool: catch-up reads
        # Its own connection for the blocking read (none of the pool's).
        self.reader = connect_async(redis_url, socket_connect_timeout=2,
                                              socket_timeout=BLOCK_MS / 1000 + 10)
        self.limit = limit
        self.revoked = revoked  # tenant ids -> those revoked
        # Open ones, subscribed or catching up; weak, so a follower whose response never
        # started (its client left first) does not count for ever.
        self.followers: weakref.WeakSet[Follower] = weakref.WeakSet()
        self.subs: dict[str, set[Follower]] = {}  # stream key -> its subscribed followers
        self.wake_key = keys.api_wake(os.urandom(6).hex())
        self.wake_last = "0"

    def open(self, key: str, last: str, tenant_id: str | None) -> Follower:
        """A follower of `key` after `last`; TooManyStreams past the limit (logged)."""
        if len(self.followers) >= self.limit:
            log.warning("refused a stream: %d followed, FANOUT_MAX_STREAMS is %d", len(self.followers), self.limit)
            raise TooManyStreams(self.limit)
        f = Follower(self, key, last, tenant_id)
        self.followers.add(f)
        asyncio.get_running_loop().create_task(self._mark({key}))
        return f

    def subscribe(self, f: Follower) -> None:
        f.subscribed = True
        self.subs.setdefault(f.key, set()).add(f)
        asyncio.get_running_loop().create_task(self._wake())

    def unsubscribe(self, f: Follower) -> None:
        self._drop(f)
        self.followers.discard(f)

    def _drop(self, f: Follower) -> None:
        f.subscribed = False
        subs = self.subs.get(f.key)
        if subs is not None:
            subs.discard(f)
            if not subs:
                del self.subs[f.key]

    async def _wake(self) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self.wake_key, {"w": 1}, maxlen=8, approximate=True)
                pipe.expire(self.wake_key, 3600)
                await pipe.execute()
        except redis.exceptions.RedisError:
            pass  # the next block ends within BLOCK_MS anyway

    async def _mark(self, stream_keys: set[str]) -> None:
        """Set the followed flags of these streams (keys.followed)."""
        if not stream_keys:
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for key in stream_keys:
                    reader.mark_followed(pipe, key)
                await pipe.execute()
        except redis.exceptions.RedisError:
            pass  # renewed at the next round; meanwhile the stream gets its finals

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(keys.FOLLOWED_RENEW)
            await self._mark({f.key for f in self.followers})

    async def run(self) -> None:
        """The reader, until cancelled; rides out Redis outages (followers see no entries)."""
        checker = asyncio.get_running_loop().create_task(self._check_keys())
        renewer = asyncio.get_running_loop().create_task(self._renew())
        try:
            while True:
                streams = {self.wake_key: self.wake_last}
                for key, subs in self.subs.items():
                    streams[key] = min((f.given for f in subs), key=events.pos)
                try:
                    got = await self.reader.xread(streams, count=COUNT, block=BLOCK_MS)
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                    log.warning("stream reader: redis unavailable (%s); trying again", e)
                    await asyncio.sleep(1.0)
                    continue
                except redis.exceptions.RedisError:  # not an outage: say so, and keep reading
                    log.exception("stream reader: the read failed; trying again")
                    await asyncio.sleep(1.0)
                    continue
                for key, entries in got or []:
                    key = _text(key)
                    self._hand_out(key, entries, streams[key])
        finally:
            checker.cancel()
            renewer.cancel()
            await self.reader.aclose()

    def _hand_out(self, key: str, entries: list, since: str) -> None:
        """Entries read after `since` to the followers they continue. A follower that
        subscribed while the read was in flight, from before `since`, gets none of them:
        the next read starts from it (it would skip what lies between)."""
        if key == self.wake_key:
            self.wake_last = _text(entries[-1][0])
            return
        start = events.pos(since)
        for f in list(self.subs.get(key, ())):
            at = events.pos(f.given)
            if at < start:
                continue
            new = [(i, fields) for i, fields in entries if events.pos(_text(i)) > at]
            if not new:
                continue
            try:
                f.queue.put_nowait(new)
                f.given = _text(new[-1][0])
            except asyncio.QueueFull:  # a slow reader: it catches up on its own from f.last
                self._drop(f)

    async def _check_keys(self) -> None:
        while True:
            await asyncio.sleep(REVOKE_CHECK)
            tenants = {f.tenant_id for f in self.followers if f.tenant_id}
            if not tenants:
                continue
            try:
                gone = await self.revoked(tenants)
            except redis.exceptions.RedisError:
                continue
            except Exception:  # noqa: BLE001 - the check must outlive one bad record
                log.exception("stream reader: looking up the followers' API keys failed")
                continue
            for f in [f for f in self.followers if f.tenant_id in gone]:
                f.closed = "the API key was revoked"
                self._drop(f)
                if not f.queue.full():
                    f.queue.put_nowait([])  # wakes its reader
