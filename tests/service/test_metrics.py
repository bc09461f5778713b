"""Prometheus metrics and JSON logs, end to end: an API with two processes (multiprocess
mode) and a worker with --metrics-port, both logging JSON, on their own Redis (no other
worker takes the jobs). Two jobs run, the second with the first's prompts (prefix-cache
hits); the counters must have moved by exactly what the jobs report."""
import json
import os
from collections import defaultdict

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import WorkerProc, start_api, wait_for
from results.client import Client
from cli.redis_server import EmbeddedRedis, free_port

PROMPTS = [f"item {i}: the quick brown fox jumps over the lazy dog, again and again" for i in range(3)]
SP = {"max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def service(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("metrics")
    server = EmbeddedRedis()
    prom_dir = logs / "prom"
    prom_dir.mkdir()
    api, url = start_api(server.url, logs, "api", args=["--workers", "2", "--log-json"],
                         env={"PROMETHEUS_MULTIPROC_DIR": str(prom_dir)})
    port = free_port()
    worker = WorkerProc(server.url, model_dir, logs, env={"FANOUT_LOG_FORMAT": "json"},
                        args=["--metrics-port", str(port), "--metrics-host", "127.0.0.1"])
    try:
        worker.start()
        yield {"api": url, "api_proc": api, "worker": worker, "prom_dir": prom_dir,
               "worker_metrics": f"http://127.0.0.1:{port}/metrics"}
    finally:
        if worker.proc:
            worker.stop()
        api.stop()
        server.stop()


def scrape(url) -> dict:
    """{(sample name, frozenset of labels): value}. A new connection each time: under
    several API processes any one of them answers."""
    resp = httpx.get(url, timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain"), resp.text
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(resp.text) for s in f.samples}


def value(samples: dict, name: str, **labels) -> float:
    """The sum over the series of `name` whose labels include `labels` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


@pytest.fixture(scope="module")
def ran(service):
    """Two jobs, one after the other, with scrapes of both endpoints before and after."""
    api, wm = service["api"], service["worker_metrics"]
    before = {"worker": scrape(wm), "api": scrape(api + "/metrics")}
    ids = []
    with Client(api) as client:
        for seed in (1, 2):
            job = client.submit(prompts=PROMPTS, sampling_params=SP, seed=seed)["id"]
            wait_for(lambda: client.status(job)["status"] == "succeeded", 60, "the job to succeed")
            ids.append(job)
        infos = [client.status(j) for j in ids]
    return {"ids": ids, "infos": infos, "before": before,
            "after": {"worker": scrape(wm), "api": scrape(api + "/metrics")}}


def test_the_workers_counters_move_by_what_its_jobs_report(service, ran):
    b, a = ran["before"]["worker"], ran["after"]["worker"]

    def delta(name, **labels):
        return value(a, name, **labels) - value(b, name, **labels)

    usage = {k: sum(i["usage"][k] for i in ran["infos"]) for k in ("prompt_tokens", "cached_tokens",
                                                                    "completion_tokens")}
    samples = 2 * len(PROMPTS)
    assert ran["infos"][1]["usage"]["cached_tokens"] > 0, ran["infos"][1]  # the first job's prefixes
    assert delta("fanout_prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("fanout_prefix_cache_hit_tokens_total") == usage["cached_tokens"]
    # n = 1: each sample prefills what the cache did not hold, and decodes all but its first token.
    assert delta("fanout_prefill_tokens_total") == usage["prompt_tokens"] - usage["cached_tokens"]
    assert delta("fanout_decode_tokens_total") == usage["completion_tokens"] - samples
    assert delta("fanout_samples_total", finish_reason="length") == samples
    assert delta("fanout_job_attempts_total", outcome="succeeded") == 2
    assert delta("fanout_job_attempts_total") == 2  # nothing retried, failed, handed back
    steps = sum(i["batching"]["steps"] for i in ran["infos"])
    assert delta("fanout_step_seconds_count") >= steps > 0
    buckets = sorted((float(dict(ls)["le"]), v) for (n, ls), v in a.items()
                     if n == "fanout_step_seconds_bucket")
    assert len(buckets) > 5 and buckets[-1] == (float("inf"), value(a, "fanout_step_seconds_count"))
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
    # Idle now: no request holds KV; the prompts' pages stay in the prefix cache.
    assert value(a, "fanout_kv_pages_used") == 0
    assert 0 < value(a, "fanout_kv_pages_cached") <= value(a, "fanout_kv_pages_capacity")
    for name in ("fanout_jobs_in_flight", "fanout_requests_running", "fanout_requests_waiting",
                 "fanout_redis_outages_total", "fanout_engine_step_failures_total"):
        assert value(a, name) == 0, name
    assert value(a, "process_start_time_seconds") > 0
    workers = {dict(ls).get("worker") for (n, ls), _ in a.items() if n.startswith("fanout_")}
    assert workers == {service["worker"].name}


def test_the_api_counts_by_route_template_across_its_processes(service, ran):
    api, job = service["api"], ran["ids"][0]
    # Fresh connections until both processes have served requests (each writes its own files).
    def pids():
        return {f.split("_")[-1] for f in os.listdir(service["prom_dir"]) if f.startswith("counter_")}

    wait_for(lambda: httpx.get(api + "/healthz").status_code == 200 and len(pids()) >= 2, 30,
             "both API processes to serve a request")
    before = scrape(api + "/metrics")
    for _ in range(10):
        assert httpx.get(f"{api}/v1/jobs/{job}").status_code == 200
    assert httpx.get(f"{api}/v1/jobs/no-such-job").status_code == 404
    scrapes = [scrape(api + "/metrics") for _ in range(6)]
    after = scrapes[0]

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    route = "/v1/jobs/{job_id}"
    assert delta("fanout_api_requests_total", method="GET", route=route, status="200") == 10
    assert delta("fanout_api_requests_total", method="GET", route=route, status="404") == 1
    # Each scrape sums every process: any process answers the same.
    key = ("fanout_api_requests_total", frozenset({"method": "GET", "route": route, "status": "200"}.items()))
    assert {s[key] for s in scrapes} == {after[key]}
    # The two submits of `ran`, whichever process took them.
    b, a = ran["before"]["api"], ran["after"]["api"]
    assert value(a, "fanout_api_requests_total", method="POST", route="/v1/jobs", status="202") \
        - value(b, "fanout_api_requests_total", method="POST", route="/v1/jobs", status="202") == 2
    # Labels are templates, never ids.
    templates = set(httpx.get(api + "/openapi.json").json()["paths"]) | {"/metrics", "unmatched"}
    routes = {dict(ls)["route"] for (n, ls), _ in after.items() if n.startswith("fanout_api_request")}
    assert route in routes and routes <= templates, routes
    assert not any(j in str(after) for j in ran["ids"])
    # Latency histogram: buckets per route, cumulative, +Inf == count.
    buckets = sorted((float(dict(ls)["le"]), v) for (n, ls), v in after.items()
                     if n == "fanout_api_request_duration_seconds_bucket" and ("route", route) in ls
                     and ("method", "GET") in ls)
    count = value(after, "fanout_api_request_duration_seconds_count", method="GET", route=route)
    assert len(buckets) > 5 and buckets[-1] == (float("inf"), count) and count >= 11
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)
    # Jobs by queue and status, from Redis.
    assert value(after, "fanout_api_redis_up") == 1
    assert value(after, "fanout_shards", queue="fanout", status="queued") == 0
    assert value(after, "fanout_shards", status="running") == value(after, "fanout_shards", status="scheduled") == 0
    assert "/metrics" not in httpx.get(api + "/openapi.json").json()["paths"]


def records(path) -> list[dict]:
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    out = [json.loads(line) for line in lines]  # every line is one JSON object
    for r in out:
        assert {"time", "level", "logger", "message"} <= r.keys(), r
    return out


def test_json_logs_carry_the_job_id(service, ran):
    ids = ran["ids"]
    worker = records(service["worker"].proc.log_path)
    by_job = defaultdict(list)
    for r in worker:
        if r["message"].startswith("job "):
            assert r["job_id"] == r["message"].split()[1].rstrip(":"), r
        if "job_id" in r:
            by_job[r["job_id"]].append(r["message"])
    for job in ids:
        assert any("attempt 1," in m for m in by_job[job]), by_job[job]
        assert any("shard 0 done" in m for m in by_job[job]), by_job[job]
    api = records(service["api_proc"].log_path)
    access = [r for r in api if r["logger"] == "uvicorn.access"]
    for job in ids:
        lines = [r for r in access if r.get("job_id") == job]
        assert any('"POST /v1/jobs ' in r["message"] for r in lines), lines  # the submit: from its Location
        assert any(f'"GET /v1/jobs/{job} ' in r["message"] for r in lines), lines
    assert all("job_id" not in r for r in access if "/healthz" in r["message"])
