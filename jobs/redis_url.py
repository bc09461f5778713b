"""Where Redis is, from one URL, for every process (the API, the workers, cron, `fanout keys`
and `fanout up`): a `redis://`, `rediss://` or `unix://` URL as redis-py reads it, or, for a
primary that Redis Sentinel watches and replaces when it fails,

    redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]
    rediss+sentinel://...          (TLS to the sentinels and the servers)

The password (and user) are the Redis servers' own, as in a `redis://` URL; sentinels that
require one of their own take `?sentinel_password=...`. The client asks the sentinels for
the primary of SERVICE on every new connection, so after a failover the next command reaches
the new primary; until the sentinels have elected it, commands fail as when Redis is away
(jobs/unavailable.py)."""
from __future__ import annotations

import asyncio
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.sentinel import Sentinel

SENTINEL = ("redis+sentinel", "rediss+sentinel")


class PoolBusy(redis.RedisError):
    """Every connection of this process's pool stayed in use for as long as a command may
    wait for one: this process is busy, Redis is not away (not a ConnectionError, so it is
    never reported as Redis being down, nor retried as one)."""


class _WaitingPool(aioredis.BlockingConnectionPool):
    async def get_connection(self, *args, **kwargs):
        try:
            return await super().get_connection(*args, **kwargs)
        except redis.ConnectionError as e:
            if isinstance(e.__cause__, asyncio.TimeoutError):  # waited `timeout` for a free one
                raise PoolBusy(f"none of this process's {self.max_connections} Redis connections came free "
                               f"within {self.timeout} s") from e
            raise


def sentinel(url: str) -> tuple[list[tuple[str, int]], str, dict, dict]:
    """(the sentinels' addresses, the service's name, the servers' connection options, the
    sentinels' own); ValueError naming what is wrong."""
    parts = urlsplit(url)
    at = parts.netloc.rpartition("@")
    user, _, password = at[0].partition(":") if at[1] else ("", "", "")
    hosts = []
    for hostport in filter(None, at[2].split(",")):
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"REDIS_URL: {hostport!r} is not HOST:PORT (a sentinel's address)")
        hosts.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not hosts or not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError("REDIS_URL: give redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]")
    tls = parts.scheme == "rediss+sentinel"
    options = {"db": int(path[1]) if len(path) == 2 else 0, "ssl": tls}
    if password:
        options["password"] = unquote(password)
    if user:
        options["username"] = unquote(user)
    own = {"ssl": tls}
    query = parse_qs(parts.query)
    if "sentinel_password" in query:
        own["password"] = query["sentinel_password"][0]
    return hosts, path[0], options, own


def _primary(sentinel_class, url: str, kwargs: dict):
    """The client of the primary that the sentinels of `url` name (sync or asyncio)."""
    hosts, service, options, own = sentinel(url)
    timeouts = {k: v for k, v in kwargs.items() if k in ("socket_connect_timeout", "socket_timeout")}
    return sentinel_class(hosts, sentinel_kwargs={**own, **timeouts}).master_for(service, **options, **kwargs)


def connect(url: str, **kwargs) -> redis.Redis:
    """A client for the Redis at `url` (kwargs: redis-py's connection options)."""
    if urlsplit(url).scheme not in SENTINEL:
        return redis.Redis.from_url(url, **kwargs)
    return _primary(Sentinel, url, kwargs)


def connect_async(url: str, pool: int | None = None, wait: float | None = None, **kwargs) -> aioredis.Redis:
    """The asyncio client for the Redis at `url`. `pool`: at most that many connections, a
    command waiting up to `wait` seconds for a free one, then PoolBusy (a sentinel-managed
    pool cannot wait: it is left unbounded instead, so that a busy moment never fails a
    command)."""
    if urlsplit(url).scheme not in SENTINEL:
        if pool is None:
            return aioredis.Redis.from_url(url, **kwargs)
        retry = kwargs.pop("retry", None)
        blocking = _WaitingPool.from_url(url, max_connections=pool, timeout=wait, **kwargs)
        return aioredis.Redis(connection_pool=blocking, retry=retry)
    return _primary(AsyncSentinel, url, kwargs)
