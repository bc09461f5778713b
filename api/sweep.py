"""The sweep: every API process, every SWEEP seconds, deletes from the blob store what its
owner no longer needs (keys.blobs_due): the bytes of a file whose object expired or was
deleted, and the items and results of a job that expired, or that was never created (its submit
failed after writing them). Whatever is due is checked against Redis first: an owner that
is still there (a file saved again, a job whose keys were kept longer) gets its own expiry
instead. A store that is down is swept once it is back. It also starts again the validations of
dataset jobs whose API process went away midway (api/validation.py)."""
from __future__ import annotations

import logging
import time

import anyio
import redis as redis_lib

from results import blobs, keys

from . import validation

log = logging.getLogger("fanout.api")
SWEEP = 10  # seconds between an API process's sweeps


async def run(state) -> None:
    while True:
        await anyio.sleep(SWEEP)
        try:
            await anyio.to_thread.run_sync(sweep_once, state.redis, state.blobs)
            await anyio.to_thread.run_sync(validation.resume_stalled, state.redis, state.blobs, state.settings)
        except (redis_lib.RedisError, blobs.StoreError) as e:
            log.warning("sweep: %s; trying again", e)


def _owner(member: str) -> tuple[str, list[str]]:
    """(the Redis key whose life the blobs follow, the blobs' keys in the store)."""
    kind, _, rest = member.partition(":")
    if kind == "file":
        return keys.file(rest), [keys.file_blob(rest)]
    job_id, start, end = rest.split(":")
    return keys.info(job_id), [blob for k in range(int(start), int(end))
                               for blob in (keys.items_blob(job_id, k), keys.results_blob(job_id, k))]


def sweep_once(redis, store: blobs.Store, now: float | None = None) -> int:
    """Delete what is due (500 owners at most); returns how many owners' blobs were deleted."""
    due = [m.decode() for m in redis.zrangebyscore(keys.blobs_due(), "-inf", now or time.time(), 0, 500)]
    deleted = 0
    for member in due:
        owner, blob_keys = _owner(member)
        left = redis.pttl(owner)
        if left == -1:  # an owner that does not expire (a file without expires_after)
            redis.zrem(keys.blobs_due(), member)
        elif left >= 0:
            redis.zadd(keys.blobs_due(), {member: time.time() + left / 1000})
        else:
            for key in blob_keys:
                store.delete(key)
            redis.zrem(keys.blobs_due(), member)
            deleted += 1
    return deleted
