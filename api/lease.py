"""A lease: the right of one API process to do one piece of work (finalize a batch,
validate a dataset job), a random token under a Redis key that expires `seconds` after its
last renewal, so a holder that died is replaced within that time, and that the work's
writes check (fencing): a holder that lost it (paused past its lease) writes nothing that
counts."""
from __future__ import annotations

import os


class Lost(Exception):
    """The work took longer than its lease between renewals: another process does it now."""


class Lease:
    _RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
    _DROP = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"

    def __init__(self, redis, key: str, seconds: int):
        self.redis, self.key, self.seconds, self.token = redis, key, seconds, os.urandom(8).hex()

    def take(self) -> bool:
        return bool(self.redis.set(self.key, self.token, nx=True, ex=self.seconds))

    def renew(self) -> bool:
        return bool(self.redis.eval(self._RENEW, 1, self.key, self.token, self.seconds * 1000))

    def held(self, pipe) -> bool:
        """Under WATCH of self.key in `pipe`: whether this process still holds it."""
        return (pipe.get(self.key) or b"").decode() == self.token

    def release(self) -> None:
        self.redis.eval(self._DROP, 1, self.key, self.token)
