"""REDIS_URL's Sentinel form, read as jobs/redis_url.py documents it."""
import pytest

from jobs.redis_url import sentinel


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_servers_options():
    hosts, service, options, own = sentinel("rediss+sentinel://:p%40ss@10.0.0.1:26379,[::1]:26380/mymaster/2"
                                            "?sentinel_password=s")
    assert hosts == [("10.0.0.1", 26379), ("::1", 26380)] and service == "mymaster"
    assert options == {"db": 2, "ssl": True, "password": "p@ss"} and own == {"ssl": True, "password": "s"}
    hosts, service, options, own = sentinel("redis+sentinel://app:pw@h:1/svc")
    assert options == {"db": 0, "ssl": False, "password": "pw", "username": "app"} and own == {"ssl": False}


@pytest.mark.parametrize("url, says", [
    ("redis+sentinel://h:1", "redis+sentinel://[[USER]:PASSWORD@]HOST:PORT"),
    ("redis+sentinel:///svc", "redis+sentinel://[[USER]:PASSWORD@]HOST:PORT"),
    ("redis+sentinel://h/svc", "'h' is not HOST:PORT"),
    ("redis+sentinel://h:1/svc/x", "redis+sentinel://[[USER]:PASSWORD@]HOST:PORT"),
])
def test_a_bad_sentinel_url_is_refused_naming_redis_url(url, says):
    with pytest.raises(ValueError, match="REDIS_URL") as e:
        sentinel(url)
    assert says in str(e.value)


def test_a_busy_pool_is_told_apart_from_redis_being_away():
    """The API's pool of connections all in use for longer than a command may wait: PoolBusy
    (the API answers 503 'this API process is busy'), not the ConnectionError that reads as
    Redis being down; once one is free, commands go through."""
    import asyncio

    import redis

    from cli.redis_server import EmbeddedRedis
    from jobs.redis_url import PoolBusy, connect_async

    server = EmbeddedRedis()

    async def main():
        client = connect_async(server.url, pool=1, wait=0.5)
        holder = asyncio.create_task(client.blpop(["nothing"], timeout=2))  # holds the one connection
        await asyncio.sleep(0.2)
        with pytest.raises(PoolBusy, match="within 0.5 s") as e:
            await client.get("x")
        assert not isinstance(e.value, redis.ConnectionError)
        await holder
        assert await client.get("x") is None
        await client.aclose(close_connection_pool=True)

    try:
        asyncio.run(main())
    finally:
        server.stop()
