"""When Redis cannot take what a Fanout process sends, and what each process does then.

Two kinds, one treatment: Redis is away (the connection lost or timed out, or it is still
loading its data after a restart: ConnectionError covers BusyLoadingError) or it is full
(`maxmemory` reached with the `noeviction` policy: it refuses every command that may grow
its memory, with OOM). A refused write applied nothing: a transaction is discarded whole,
and a script is refused before its first write or not at all. So the API answers 503 with
Retry-After, and the worker pauses and tries again (worker/outage.py), exactly as for a
lost connection, whose writes it checks before sending them again.
"""
from __future__ import annotations

from redis.exceptions import ConnectionError, OutOfMemoryError, TimeoutError

REDIS_DOWN = (ConnectionError, TimeoutError, OutOfMemoryError)
RETRY_AFTER = 5  # seconds a client is told to wait (Retry-After) on a 503 or 429 of the API


def describe(e: Exception) -> str:
    """What a client or an operator is told, without where Redis lives."""
    if isinstance(e, OutOfMemoryError):
        return "redis is out of memory (maxmemory reached): it takes no writes until memory is freed"
    return "redis unavailable"
