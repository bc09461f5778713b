"""Redis (append-only persistence) stopped for 3 s mid-job and started again on the same port
and data: the worker stays up with its engine, pauses and carries on; the job completes
with every sample final exactly once; the API answers 503 JSON meanwhile and 200 after."""
import re
import time
from collections import Counter

import httpx
import redis as redis_lib

from conftest import WorkerProc, start_api
from results import keys, reader
from results.client import Client
from cli.redis_server import EmbeddedRedis, free_port
from worker.engine import SamplingParams

OUTAGE_S = 3
PROMPTS = ["Hello", "def fibonacci(n):", "The quick brown fox", "import os"]
SP = {"max_new_tokens": 100, "n": 2, "temperature": 0.8, "ignore_eos": True}


def resumed_in_place(r, client, engine, job: str, rest: list, since: float) -> tuple[float, list[dict], dict]:
    """The job carried on in the same attempt and completed: each sample final once, equal to
    the engine's. Returns how long after `since` the worker wrote again, and the stream."""
    assert rest[-1][1]["status"] == "succeeded", rest[-1]
    resumed_in = min(t for t in (int(i.split("-")[0]) / 1000 - since for i, _ in rest) if t > 0)
    assert resumed_in < 6, f"the worker wrote again {resumed_in:.1f}s after Redis took writes again"
    info = client.status(job)
    assert info["status"] == "succeeded" and info["attempt"] == 1, info  # in place: nothing handed back
    assert info["usage"]["completion_tokens"] == len(PROMPTS) * 2 * 100  # nothing lost or counted twice
    es = [reader.events.decode(f) for _, f in r.xrange(keys.stream(job))]
    finals = Counter((e["index"], e["sample"]) for e in es if e["type"] == "final")
    assert len(finals) == len(PROMPTS) * 2 and set(finals.values()) == {1}
    items = client.results(job)
    got = {(it["index"], s["sample"]): s["token_ids"] for it in items for s in it["samples"]}
    ref = engine.generate(prompts=PROMPTS, sampling_params=SamplingParams(**SP), seed=11)
    assert got == {(it.index, j): s.token_ids for it in ref for j, s in enumerate(it.samples)}
    return resumed_in, es, got


def test_the_worker_and_the_api_ride_out_a_redis_restart(model_dir, engine, tmp_path):
    data, port = str(tmp_path / "redis"), free_port()
    server = EmbeddedRedis(data_dir=data, port=port)
    api, url = start_api(server.url, tmp_path, "api")
    worker = WorkerProc(server.url, model_dir, tmp_path)
    try:
        worker.start()
        client = Client(url)
        job = client.submit(prompts=PROMPTS, sampling_params=SP, seed=11)["id"]
        r = redis_lib.Redis.from_url(server.url)  # the same URL after the restart
        it = reader.follow(r, job, timeout=60)
        next(e for _, e in it if e["type"] == "delta")

        server.stop()
        down = time.monotonic()
        with httpx.Client(base_url=url, timeout=10) as http:
            for method, path, body in [("GET", f"/v1/jobs/{job}", None), ("POST", "/v1/jobs", {"prompts": ["x"]}),
                                       ("GET", f"/v1/jobs/{job}/results", None), ("GET", f"/v1/jobs/{job}/events", None),
                                       ("POST", f"/v1/jobs/{job}/cancel", None), ("GET", "/healthz", None)]:
                t = time.monotonic()
                resp = http.request(method, path, json=body)
                assert resp.status_code == 503, (path, resp.status_code, resp.text)
                assert resp.json()["detail"].startswith("redis unavailable (ref "), resp.text
                assert resp.headers["Retry-After"] == "5", (path, resp.headers)
                assert str(port) not in resp.text and "127.0.0.1" not in resp.text  # logged, not told
                assert time.monotonic() - t < 2, f"{path}: the 503 took {time.monotonic() - t:.1f}s"
            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down)))
            assert worker.proc.alive(), worker.proc.tail()
            server = EmbeddedRedis(data_dir=data, port=port)
            up = time.time()
            # The API's pooled connections to the old server are replaced on first use.
            assert http.get(f"/v1/jobs/{job}").status_code == 200
            assert http.get("/healthz").status_code == 200

        _, es, got = resumed_in_place(r, client, engine, job, list(it), up)  # where it stopped
        rb = reader.Rebuilder()
        for e in es:
            rb.apply(e)
        assert {k: o.token_ids for k, o in rb.outputs.items()} == got

        # The same worker process, engine loaded once; one log line per backoff step.
        assert worker.proc.alive()
        log = open(worker.proc.log_path).read()
        assert log.count(" loaded ") == 1 and "Traceback" not in log, log[-3000:]
        assert 1 <= log.count("redis unavailable") <= 6 and log.count("redis is back") == 1, log[-3000:]
        client.close()
        r.close()
    finally:
        worker.stop()
        api.stop()
        server.stop()


def test_a_full_redis_pauses_the_worker_and_the_api_says_so(model_dir, engine, tmp_path):
    """Redis at its maxmemory (noeviction) refuses every write for 3 s mid-job: the worker
    pauses (no exit, nothing handed back), the API answers 503 naming the cause with
    Retry-After (reads still answer), /healthz says so; once memory is freed the job carries
    on in place and completes, each sample final once and equal to the engine's. Before:
    both the API (500) and the worker (it exited on the OOM error) failed."""
    server = EmbeddedRedis()
    api, url = start_api(server.url, tmp_path, "api")
    worker = WorkerProc(server.url, model_dir, tmp_path)
    r = redis_lib.Redis.from_url(server.url)
    try:
        worker.start()
        client = Client(url)
        job = client.submit(prompts=PROMPTS, sampling_params=SP, seed=11)["id"]
        it = reader.follow(r, job, timeout=60)
        next(e for _, e in it if e["type"] == "delta")

        r.config_set("maxmemory", 1)  # past it: every write that may grow memory is refused
        full = time.monotonic()
        with httpx.Client(base_url=url, timeout=10) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]  # reads go on
            for path, body in (("/v1/jobs", {"prompts": ["x"]}),
                               ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}]})):
                resp = http.post(path, json=body)
                assert resp.status_code == 503, (path, resp.status_code, resp.text)
                assert "out of memory" in resp.text and resp.headers["Retry-After"] == "5", resp.text
            health = http.get("/healthz")
            assert health.status_code == 503 and "out of memory" in health.text and health.headers["Retry-After"]
            assert http.get(f"/v1/jobs/{job}").status_code == 200  # reads go on
            scrape = http.get("/metrics").text  # what an operator's alert reads
            used = float(re.search(r"^fanout_redis_memory_used_bytes (\S+)$", scrape, re.M).group(1))
            assert re.search(r"^fanout_redis_memory_max_bytes 1\.0$", scrape, re.M) and used > 1, scrape[-2000:]
            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - full)))
            assert worker.proc.alive(), worker.proc.tail()
            r.config_set("maxmemory", 0)
            freed = time.time()
            assert http.get("/healthz").status_code == 200

        resumed_in, _, _ = resumed_in_place(r, client, engine, job, list(it), freed)  # where it paused
        assert worker.proc.alive()
        log = open(worker.proc.log_path).read()
        assert "Traceback" not in log and "handed back" not in log, log[-3000:]
        assert "redis is out of memory" in log and log.count("redis is back") == 1, log[-3000:]
        print(f"\nfull redis for {OUTAGE_S} s: the worker wrote again {resumed_in:.2f} s after memory was freed")
        client.close()
    finally:
        r.close()
        worker.stop()
        api.stop()
        server.stop()
