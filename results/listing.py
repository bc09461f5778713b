"""The job listings and their status indexes: GET /v1/jobs without describing every job.

Each job is in one listing (keys.jobs: its tenant's, or the open one), a sorted set scored by
submit time, and in that listing's index of its status (keys.by_status), scored the same. A
status change moves it between indexes in the transaction (or script) that changes the
status: submit (validating, for a dataset; queued / scheduled), a shard's claim (running), a shard handed back with none
running (queued), the close (succeeded / failed / canceled). Its info hash names its listing
(`listed`), so the scripts find it. Pages go by (score, id), newest first, so a job that
changes status between two pages neither repeats nor hides the others. Entries of expired
jobs go when a listing meets them, or when a submit trims what is older than any job lives.
"""
from __future__ import annotations

from . import keys

STATUSES = ("validating", "queued", "scheduled", "running", "succeeded", "failed", "canceled")

# Lua: set the job's state and move it to that state's index. Included in the scripts that
# change a state (jobs/shards.py, publisher._CLOSE); `info` the info hash key, `job` its id.
SET_STATE = """
local function set_state(info, job, new)
  local listed = redis.call('HGET', info, 'listed')
  local old = redis.call('HGET', info, 'state')
  redis.call('HSET', info, 'state', new)
  if not listed or old == new then return end
  if old then redis.call('ZREM', listed .. ':' .. old, job) end
  local score = redis.call('ZSCORE', listed, job)
  if score then redis.call('ZADD', listed .. ':' .. new, score, job) end
end
"""
_SET = SET_STATE + "set_state(KEYS[1], ARGV[1], ARGV[2])"


def set_state(pipe, job_id: str, state: str) -> None:
    """Queue a state change (and its index move) on a pipeline or client."""
    pipe.eval(_SET, 1, keys.info(job_id), job_id, state)


def add(pipe, listed: str, job_id: str, state: str, now: float, cutoff: float) -> None:
    """A new job: in its listing and its state's index; what is older than `cutoff` goes
    (those jobs have expired)."""
    pipe.zadd(listed, {job_id: now})
    pipe.zadd(keys.by_status(listed, state), {job_id: now})
    for k in [listed] + [keys.by_status(listed, s) for s in STATUSES]:
        pipe.zremrangebyscore(k, 0, cutoff)


def page(redis, key: str, after: tuple[float, str] | None, count: int) -> list[tuple[str, float]]:
    """Up to `count` (id, score) of a listing or index, newest first, after the cursor
    (score, id) of the last one seen. Equal scores come in reverse id order, as ZREVRANGE
    gives them."""
    top = "+inf" if after is None else after[0]
    out, start = [], 0
    while len(out) < count:
        rows = redis.zrevrangebyscore(key, top, "-inf", start=start, num=count + 16, withscores=True)
        if not rows:
            break
        start += len(rows)
        for member, score in rows:
            member = member.decode() if isinstance(member, bytes) else member
            if after is not None and score == after[0] and member >= after[1]:
                continue  # at the cursor's score: only the ids after it
            out.append((member, score))
            if len(out) == count:
                break
    return out
