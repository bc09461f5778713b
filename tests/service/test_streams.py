"""A thousand streams on one API process (api/streams.py): SSE followers and streamed chats
at once, every event delivered to every one, Redis connections bounded; past
FANOUT_MAX_STREAMS a clear, logged 503; a revoked key's open streams end within seconds.
Its own Redis, API processes and one worker (the tiny model)."""
import asyncio
import json
import time

import httpx
import pytest
import redis as redis_lib

from api import tenants
from api.streams import REVOKE_CHECK
from conftest import WorkerProc, start_api, wait_for
from results import keys
from cli.redis_server import EmbeddedRedis

SSE_JOBS, SSE_PER_JOB, CHATS = 8, 100, 200  # 1,000 streams


@pytest.fixture(scope="module")
def service(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("streams")
    server = EmbeddedRedis()
    api, url = start_api(server.url, logs, "api")
    worker = WorkerProc(server.url, model_dir, logs)
    worker.start()
    r = redis_lib.Redis.from_url(server.url)
    yield {"url": url, "redis": r, "server": server, "logs": logs}
    worker.stop()
    api.stop()
    r.close()
    server.stop()


async def sse(client, job_id, headers=None):
    """Every (id, event, data) of the job's SSE stream."""
    got = []
    async with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as resp:
        assert resp.status_code == 200, await resp.aread()
        event = {}
        async for line in resp.aiter_lines():
            if line.startswith(("id", "event", "data")):
                k, _, v = line.partition(": ")
                event[k] = v
            elif not line and event:
                got.append((event.get("id"), event["event"], json.loads(event["data"])))
                event = {}
    return got


async def chat(client, i, headers=None):
    """The text of a streamed chat, and whether it ended with [DONE]."""
    body = {"model": "llama", "messages": [{"role": "user", "content": f"stream {i}"}], "max_tokens": 12,
            "temperature": 0, "stream": True}
    text, done, errors = "", False, []
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk["error"])
                for c in chunk.get("choices", []):
                    text += c["delta"].get("content") or ""
    return text, done, errors


def test_a_thousand_streams_on_one_api_process_every_event_delivered(service):
    r, url = service["redis"], service["url"]
    sp = {"max_new_tokens": 120, "ignore_eos": True, "temperature": 0.7}
    job_ids = [httpx.post(url + "/v1/jobs", json={"prompts": [f"job {j} item {i}" for i in range(4)],
                                                  "sampling_params": sp, "seed": j}).json()["id"]
               for j in range(SSE_JOBS)]
    peak = {"clients": 0}

    async def watch_connections(stop):
        while not stop.is_set():
            peak["clients"] = max(peak["clients"], len(r.client_list()))
            await asyncio.sleep(0.2)

    async def main():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300) as client:
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch_connections(stop))
            tasks = [sse(client, j) for j in job_ids for _ in range(SSE_PER_JOB)]
            tasks += [chat(client, i) for i in range(CHATS)]
            out = await asyncio.gather(*tasks)
            stop.set()
            await watcher
            return out[:SSE_JOBS * SSE_PER_JOB], out[SSE_JOBS * SSE_PER_JOB:]

    t = time.monotonic()
    followed, chats = asyncio.run(main())
    took = time.monotonic() - t
    for k, job_id in enumerate(job_ids):
        want = [(i.decode(), json.loads(f[b"data"]) if b"data" in f else None) for i, f in r.xrange(keys.stream(job_id))]
        want_ids = [i for i, _ in want]
        for got in followed[k * SSE_PER_JOB:(k + 1) * SSE_PER_JOB]:
            assert [i for i, _, _ in got] == want_ids  # every entry, in order, once
            assert got[-1][2]["type"] == "status" and got[-1][2]["status"] == "succeeded"
    texts = [c[0] for c in chats]
    assert all(done and not errors for _, done, errors in chats)
    assert all(texts) and len(set(texts)) > 1
    # One reader for all of them: the API's connections stay a pool's worth (64 for short
    # async reads, one per thread of anyio's 40 for the sync calls, the reader's), not 1,000.
    assert peak["clients"] < 64 + 40 + 16, peak
    print(f"1,000 streams ({SSE_JOBS * SSE_PER_JOB} SSE, {CHATS} chats) in {took:.1f}s; "
          f"peak Redis clients {peak['clients']}")


def test_past_the_limit_a_clear_logged_503(service, tmp_path):
    api, url = start_api(service["server"].url, tmp_path, "api-limited", env={"FANOUT_MAX_STREAMS": "3"})
    try:
        # 64 rows of 1,000 tokens: seconds of work, so the held streams are open when the
        # fourth comes (a single row ran to its end in ~1 s on a fast machine).
        body = {"prompts": [f"held open {i}" for i in range(8)],
                "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "n": 8}}
        job = httpx.post(url + "/v1/jobs", json=body).json()["id"]

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                held = [asyncio.create_task(sse(client, job)) for _ in range(3)]
                await asyncio.sleep(1.0)
                over = await client.get(f"/v1/jobs/{job}/events")
                chat_over = await client.post("/v1/chat/completions", json={
                    "model": "llama", "messages": [{"role": "user", "content": "x"}], "stream": True})
                jobs_before = len(httpx.get(url + "/v1/jobs", params={"limit": 100}).json()["data"])
                httpx.post(f"{url}/v1/jobs/{job}/cancel")
                got = await asyncio.gather(*held)
                return over, chat_over, got, jobs_before

        over, chat_over, got, jobs_before = asyncio.run(main())
        assert over.status_code == 503 and "FANOUT_MAX_STREAMS" in over.json()["detail"]
        assert over.headers["retry-after"] == "5"
        assert chat_over.status_code == 503
        assert chat_over.json()["error"]["code"] == "too_many_streams"
        # No job was made for the refused chat.
        assert len(httpx.get(url + "/v1/jobs", params={"limit": 100}).json()["data"]) == jobs_before
        # The three held ones went on to the end: every entry of the job's stream, closed by
        # its final status (canceled, or succeeded if the job beat the cancel on a fast machine).
        want = [i.decode() for i, _ in service["redis"].xrange(keys.stream(job))]
        final = httpx.get(f"{url}/v1/jobs/{job}").json()["status"]
        assert final in ("canceled", "succeeded")
        for g in got:
            assert [i for i, _, _ in g] == want
            assert g[-1][2]["type"] == "status" and g[-1][2]["status"] == final
        wait_for(lambda: "refused a stream" in (tmp_path / "api-limited.log").read_text(), 10, "the log line")
    finally:
        api.stop()


def test_revoking_a_key_ends_its_open_streams_within_seconds(model_dir, tmp_path):
    """SSE followers and a streamed chat of a key that gets revoked end within seconds, with a
    closing event (the chat's job is canceled); another key's stream goes on. Its own Redis
    (keys switch auth on for every client of a Redis) and a worker that registers, then is
    stopped (SIGSTOP): the jobs wait, so the streams are open when the key is revoked."""
    import signal

    server = EmbeddedRedis()
    r = redis_lib.Redis.from_url(server.url)
    api, url = start_api(server.url, tmp_path, "api-revoke")
    worker = WorkerProc(server.url, model_dir, tmp_path)
    try:
        worker.start()
        worker.proc.proc.send_signal(signal.SIGSTOP)
        key, tenant = tenants.create(r, "revoked-soon", {})
        other, _ = tenants.create(r, "stays", {})
        auth, keep = {"Authorization": f"Bearer {key}"}, {"Authorization": f"Bearer {other}"}
        job = httpx.post(url + "/v1/jobs", headers=auth, json={"prompts": ["long"]}).json()["id"]
        kept = httpx.post(url + "/v1/jobs", headers=keep, json={"prompts": ["long"]}).json()["id"]

        async def chat_status(client):
            body = {"model": "llama", "messages": [{"role": "user", "content": "x"}], "stream": True}
            resp = await client.post("/v1/chat/completions", json=body, headers=auth)
            return resp.status_code, resp.json()

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                cut = [asyncio.create_task(sse(client, job, auth)) for _ in range(3)]
                chatting = asyncio.create_task(chat_status(client))
                stays = asyncio.create_task(sse(client, kept, keep))
                await asyncio.sleep(1.5)
                assert not any(t.done() for t in cut + [chatting, stays])
                t = time.monotonic()
                tenants.revoke(r, tenant.id)
                got = await asyncio.gather(*cut)
                answer = await chatting
                took = time.monotonic() - t
                assert not stays.done()  # another key's stream goes on
                stays.cancel()
                return got, answer, took

        got, (status, answer), took = asyncio.run(main())
        for events in got:
            _, kind, data = events[-1]
            assert kind == "closed" and data["reason"] == "the API key was revoked" and data["last_id"]
        assert status == 401 and answer["error"]["code"] == "revoked_api_key", answer
        assert took < REVOKE_CHECK + 5
        assert httpx.get(f"{url}/v1/jobs/{job}", headers=auth).status_code == 401
        print(f"revoked key: its streams closed {took:.1f}s after the revocation")
    finally:
        if worker.proc and worker.proc.alive():
            worker.proc.proc.send_signal(signal.SIGCONT)
            worker.stop()
        api.stop()
        r.close()
        server.stop()


def test_a_read_that_started_past_a_new_subscriber_hands_it_nothing():
    """The race once seen in this file's thousand-stream test (four entries skipped): a
    follower subscribes, from before where the hub's in-flight read started (the others
    were further on), and that read's entries must not move it past the ones in between;
    the next read starts from it."""
    from api.streams import Hub

    async def main():
        hub = Hub("redis://127.0.0.1:1/0", None, 10, None)  # no connection is made here
        ahead, behind = hub.open("s", "5-0", None), hub.open("s", "2-0", None)
        for f in (ahead, behind):
            f.subscribed = True
            hub.subs.setdefault("s", set()).add(f)
        read = [(b"6-0", {}), (b"7-0", {})]  # a read from 5-0, before `behind` subscribed
        hub._hand_out("s", read, "5-0")
        assert ahead.queue.get_nowait() == [(b"6-0", {}), (b"7-0", {})] and ahead.given == "7-0"
        assert behind.queue.empty() and behind.given == "2-0"
        hub._hand_out("s", [(b"3-0", {}), (b"6-0", {}), (b"7-0", {}), (b"8-0", {})], "2-0")  # the next read
        assert [i for i, _ in behind.queue.get_nowait()] == [b"3-0", b"6-0", b"7-0", b"8-0"]
        assert [i for i, _ in ahead.queue.get_nowait()] == [b"8-0"]
        await hub.reader.aclose()

    asyncio.run(main())
