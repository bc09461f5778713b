"""The worker's side of the result channel.

A `Batch` collects one engine step's writes for every job and sends them in one
MULTI/EXEC: each finished sample is HSET (and counted) before the XADD that announces
it, so nothing is announced that is not stored. It records its commands, so it can be
sent again after a lost connection (the worker decides whether it must be). `close`
writes a job's terminal status entry exactly once, whoever (worker, API or a reaper)
gets there first, and sets the expiry of all the job's keys.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from . import events, keys, listing, progress, store

# KEYS: closed, stream, results, info, cancel, custom_ids, shards, running, kept (all expired),
# items (deleted: the input is not needed once the job ended), the stream's followed flag
# (deleted: nothing streams after the close), the webhook outbox.
# ARGV: ttl, status, ended_at, job id, field, value, ...
# A succeeded job has no error: an earlier attempt's (reaped, retried) stays in the stream.
# A tenant's job gives back its in-flight slot here, exactly once: the info hash names the
# counter (api.jobs.submit), so this reaches a key not in KEYS (fine outside Redis Cluster).
# A job with a webhook has its delivery due at once, in the same transaction: a process
# that dies after the close cannot lose it (api/webhooks.py sends it). A job whose info hash
# has its own `ttl` (an online request's: api/jobs.py create) keeps its keys that long, not ttl.
_CLOSE = listing.SET_STATE + """
local ttl = redis.call('HGET', KEYS[4], 'ttl') or ARGV[1]
if not redis.call('SET', KEYS[1], ARGV[2], 'NX', 'EX', ttl) then return false end
set_state(KEYS[4], ARGV[4], ARGV[2])
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 5))
local slot = redis.call('HGET', KEYS[4], 'slot')
if slot then redis.call('DECR', slot) end
redis.call('HSET', KEYS[4], 'ended_at', ARGV[3])
if ARGV[2] == 'succeeded' then redis.call('HDEL', KEYS[4], 'error') end
if redis.call('HEXISTS', KEYS[4], 'webhook') == 1 then
  redis.call('ZADD', KEYS[#KEYS], 0, 'job:' .. ARGV[4])
end
redis.call('DEL', KEYS[#KEYS - 2], KEYS[#KEYS - 1])
for i = 2, #KEYS - 3 do redis.call('EXPIRE', KEYS[i], ttl) end
return id
"""


_AT_LEAST = """
if tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') < tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
"""


class Commands(list):
    """Redis commands recorded for one transaction: `commands.hset(...)` appends HSET."""

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.append((name, args, kwargs))


class Batch:
    def __init__(self, redis):
        self.redis = redis
        self.pipe = Commands()
        self.jobs: set[str] = set()  # the jobs it writes for
        self.counts: defaultdict[str, Counter] = defaultdict(Counter)  # job -> progress increments
        self.reads: list[tuple[str, tuple]] = []  # answered in the same round trip, after the writes

    def delta(self, job_id: str, index: int, sample: int, text: str, token_ids: list[int],
              logprobs: list[dict] | None = None, custom_id: str | None = None) -> None:
        self.jobs.add(job_id)
        self.pipe.xadd(keys.stream(job_id), events.delta(index, sample, text, token_ids, logprobs, custom_id))

    def final(self, job_id: str, index: int, sample: int, text_delta: str, ids_delta: list[int],
              record: dict, item_done: bool, item_failed: bool, custom_id: str | None = None) -> None:
        self.jobs.add(job_id)
        store.put(self.pipe, job_id, index, sample, record)
        progress.count_sample(self.counts[job_id], record, item_done, item_failed)
        if record["finish_reason"] == "error":
            entry = events.error(index, sample, record["error"] or "error", custom_id)
        else:
            entry = events.final(index, sample, text_delta, ids_delta, record, custom_id)
        self.pipe.xadd(keys.stream(job_id), entry)

    def status(self, job_id: str, value: str, **extra) -> None:
        self.jobs.add(job_id)
        self.pipe.xadd(keys.stream(job_id), events.status(value, **extra))

    def info(self, job_id: str, **fields) -> None:
        self.jobs.add(job_id)
        self.pipe.hset(keys.info(job_id), mapping=fields)

    def close(self, job_id: str, status: str, ttl: int, **extra) -> None:
        """`close` in this transaction."""
        self.jobs.add(job_id)
        self.pipe.eval(_CLOSE, *_close_args(job_id, status, ttl, extra))

    def at_least(self, job_id: str, name: str, value: int) -> None:
        """Raise the info hash's `name` to `value` if it is lower (workers write it in turn)."""
        self.jobs.add(job_id)
        self.pipe.eval(_AT_LEAST, 1, keys.info(job_id), name, value)

    def expire(self, job_id: str, ttl: int) -> None:
        self.jobs.add(job_id)
        for k in keys.all_for(job_id):
            self.pipe.expire(k, ttl)

    def read(self, command: str, *args) -> None:
        """Queue a read (e.g. "mget", keys) to run after the writes; send() returns its answer."""
        self.reads.append((command, args))

    def send(self, pipe=None) -> list:
        """One MULTI/EXEC: readers see a step's samples, counters and entries together.
        Returns the answers of the queued reads. `pipe`: a transaction already opened
        (WATCH, then MULTI) to send these commands with its own."""
        pipe = pipe if pipe is not None else self.redis.pipeline(transaction=True)
        with pipe:
            for command, args, kwargs in self.pipe:
                getattr(pipe, command)(*args, **kwargs)
            for job_id, counts in self.counts.items():
                for name, n in counts.items():
                    if n:
                        pipe.hincrby(keys.info(job_id), name, n)
            for command, args in self.reads:
                getattr(pipe, command)(*args)
            if not len(pipe):
                return []
            results = pipe.execute()
        return results[len(results) - len(self.reads):]


def _close_args(job_id: str, status: str, ttl: int, extra: dict) -> list:
    fields = events.status(status, **extra)
    argv = [ttl, status, progress.timestamp(), job_id]
    argv += [x for kv in fields.items() for x in kv]
    ks = [keys.closed(job_id), keys.stream(job_id), keys.results(job_id), keys.info(job_id),
          keys.cancel(job_id), keys.custom_ids(job_id), keys.shards(job_id), keys.running(job_id),
          keys.kept(job_id), keys.items(job_id), keys.followed(keys.stream(job_id)), keys.webhooks()]
    return [len(ks), *ks, *argv]


def close(redis, job_id: str, status: str, ttl: int, **extra) -> str | None:
    """Write the terminal status entry once; returns its stream id, or None if the job was
    already closed."""
    entry_id = redis.eval(_CLOSE, *_close_args(job_id, status, ttl, extra))
    if entry_id is None:
        return None
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id
