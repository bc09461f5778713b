"""The HTTP API on its own: validation, lookups, idempotency, cancel before start, OpenAPI."""
import json
import os
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from rq.job import Job
from rq.registry import ScheduledJobRegistry
from rq.serializers import JSONSerializer

from results import keys


@pytest.fixture
def http(api_url):
    with httpx.Client(base_url=api_url, timeout=10) as c:
        yield c


def later(seconds=3600):
    return (datetime.now(timezone.utc) + timedelta(seconds=seconds)).isoformat()


BAD = [
    ({}, ["body"], "exactly one of"),
    ({"prompts": []}, ["body", "prompts"], "at least 1"),
    ({"prompts": [""]}, ["body", "prompts", 0], "at least 1"),
    ({"prompts": ["a"], "input_ids": [[1]]}, ["body"], "exactly one of"),
    ({"input_ids": [[1, -2]]}, ["body", "input_ids", 0, 1], "greater than or equal"),
    ({"input_ids": [[]]}, ["body", "input_ids", 0], "at least 1"),
    ({"messages": [[{"role": "user"}]]}, ["body", "messages", 0, 0, "content"], "Field required"),
    ({"prompts": ["a"], "temperature": 0.5}, ["body", "temperature"], "Extra inputs"),
    ({"prompts": ["a"], "sampling_params": {"top_p": 0}}, ["body", "sampling_params", "top_p"], "greater than 0"),
    ({"prompts": ["a"], "sampling_params": {"temperature": -1}}, ["body", "sampling_params", "temperature"],
     "greater than or equal"),
    ({"prompts": ["a"], "sampling_params": {"max_new_tokens": "5"}}, ["body", "sampling_params", "max_new_tokens"],
     "valid integer"),
    ({"prompts": ["a"], "sampling_params": {"n": 0}}, ["body", "sampling_params", "n"], "greater than or equal"),
    ({"prompts": ["a"], "sampling_params": {"top_k": -5}}, ["body", "sampling_params", "top_k"], "-1"),
    ({"prompts": ["a"], "sampling_params": {"bogus": 1}}, ["body", "sampling_params", "bogus"], "Extra inputs"),
    ({"prompts": ["a", "b"], "sampling_params": [{}]}, ["body", "sampling_params"], "1 entries for 2 items"),
    ({"prompts": ["a", "b"], "sampling_params": [{}, {"n": 0}]}, ["body", "sampling_params", 1, "n"],
     "greater than or equal"),
    ({"prompts": ["a"], "sampling_params": {"top_k": 2**63}}, ["body", "sampling_params", "top_k"], "less than"),
    ({"prompts": ["a"], "sampling_params": {"stop_token_ids": [2**63]}},
     ["body", "sampling_params", "stop_token_ids", 0], "less than"),
    ({"prompts": ["a"], "sampling_params": {"top_logprobs": 3}}, ["body", "sampling_params"], "needs logprobs"),
    ({"prompts": ["a"], "sampling_params": {"json_schema": {"$ref": "#"}}}, ["body", "sampling_params", "json_schema"],
     "leads back to itself"),
    ({"prompts": ["a"], "sampling_params": {"json_schema": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {
        "$ref": "#/$defs/a", "description": "b"}}, "$ref": "#/$defs/a"}}},
     ["body", "sampling_params", "json_schema"], "leads back to itself"),
    ({"prompts": ["a"], "sampling_params": {"seed": 2**63}}, ["body", "sampling_params", "seed"], "less than"),
    ({"prompts": ["a"], "priority": "urgent"}, ["body", "priority"], "high"),
    ({"prompts": ["a"], "metadata": "note"}, ["body", "metadata"], "valid dictionary"),
    ({"prompts": ["a"], "metadata": {"k": {"nested": 1}}}, ["body", "metadata", "k"], "valid string"),
    ({"prompts": ["a"], "metadata": {str(i): "v" for i in range(17)}}, ["body", "metadata"], "at most 16"),
    ({"prompts": ["a"], "metadata": {"k": "v" * 513}}, ["body", "metadata", "k"], "at most 512"),
    ({"prompts": ["a"], "run_at": "2030-01-01T00:00:00"}, ["body", "run_at"], "timezone"),
    ({"prompts": ["a"], "run_at": "1969-12-31T23:59:59Z"}, ["body", "run_at"], "after 1970"),
    # Configured limits (conftest.LIMITS).
    ({"prompts": ["a"] * 65}, ["body", "prompts"], "FANOUT_MAX_BATCH"),
    ({"prompts": ["a"], "sampling_params": {"max_new_tokens": 1001}}, ["body", "sampling_params", "max_new_tokens"],
     "FANOUT_MAX_NEW_TOKENS"),
    ({"prompts": ["a", "b"], "sampling_params": [{}, {"n": 9}]}, ["body", "sampling_params", 1, "n"],
     "FANOUT_MAX_N"),
]


@pytest.mark.parametrize("body,loc,msg", BAD, ids=[str(b[1][1:]) + b[2] for b in BAD])
def test_bad_bodies_get_422_naming_the_field(http, body, loc, msg):
    r = http.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    errors = r.json()["detail"]
    assert any(e["loc"] == loc and msg in e["msg"] for e in errors), errors


def test_body_too_large_and_not_json(http):
    r = http.post("/v1/jobs", json={"prompts": ["x" * 250_000]})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body"], r.text
    assert "FANOUT_MAX_BODY_BYTES" in r.json()["detail"][0]["msg"]

    def chunks():  # no Content-Length: the limit answers once the bytes arrive
        for _ in range(5):
            yield b"x" * 60_000
    r = http.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body"], r.text
    r = http.post("/v1/jobs", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"


def test_unknown_job_is_404_everywhere(http):
    for method, path in [("GET", "/v1/jobs/nope"), ("GET", "/v1/jobs/nope/results"),
                         ("GET", "/v1/jobs/nope/events"), ("POST", "/v1/jobs/nope/cancel")]:
        r = http.request(method, path)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json() == {"detail": "job not found: nope"}


def test_bad_stream_ids_get_422(http):
    job = http.post("/v1/jobs", json={"prompts": ["a"], "run_at": later()}).json()
    url = f"/v1/jobs/{job['id']}/events"
    for headers, params, loc in [
            ({"Last-Event-ID": "99999999999999999999999"}, {}, ["header", "last-event-id"]),
            ({"Last-Event-ID": "1-18446744073709551616"}, {}, ["header", "last-event-id"]),
            ({}, {"after": "123\n"}, ["query", "after"]),
            ({}, {"after": "1-2-3"}, ["query", "after"])]:
        r = http.get(url, headers=headers, params=params)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == loc, (headers, params, r.text)
    http.post(f"/v1/jobs/{job['id']}/cancel")
    # Resuming after the terminal entry (here: the largest id there is) ends the stream
    # after one keep-alive instead of waiting forever.
    r = http.get(url, params={"after": "18446744073709551615-0"})
    assert r.status_code == 200 and r.text == ": keep-alive\n\n"


def test_scheduled_job_then_cancel_before_it_starts(http, redis, api_pair):
    r = http.post("/v1/jobs", json={"prompts": ["a", "b"], "run_at": later(), "metadata": {"team": "x"},
                                    "sampling_params": {"n": 3, "seed": 42}})
    assert r.status_code == 202, r.text
    job = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] == "scheduled" and job["seed"] == 42 and job["items"] == 2
    assert job["stream"] == keys.stream(job["id"])
    # Another API process answers for the same job.
    with httpx.Client(base_url=api_pair[1], timeout=10) as other:
        info = other.get(f"/v1/jobs/{job['id']}").json()
    assert info["status"] == "scheduled" and info["metadata"] == {"team": "x"}
    assert info["progress"] == {"total": 2, "done": 0, "failed": 0, "samples": 6, "samples_done": 0}
    assert info["shards"] == {"total": 1, "queued": 1, "running": 0, "done": 0, "pending": 0, "workers": []}
    rq_job = Job.fetch(job["id"] + "-0", connection=redis, serializer=JSONSerializer)
    assert rq_job.id in ScheduledJobRegistry(rq_job.origin, connection=redis)

    r = http.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 202 and r.json() == {"id": job["id"], "status": "canceled"}
    assert http.get(f"/v1/jobs/{job['id']}").json()["status"] == "canceled"
    assert not Job.exists(rq_job.id, connection=redis)  # its shards left rq's queues
    assert rq_job.id not in ScheduledJobRegistry(rq_job.origin, connection=redis)
    assert http.post(f"/v1/jobs/{job['id']}/cancel").status_code == 409
    # The stream ends with the terminal status; SSE replays it and closes.
    text = http.get(f"/v1/jobs/{job['id']}/events").text
    assert text.count("event: status") == 2 and '"status": "canceled"' in text


def test_api_and_engine_accept_the_same_sampling_fields_with_the_same_defaults(http):
    """One definition: the HTTP schema of sampling_params is the engine's SamplingParams."""
    from worker.engine.sampling_params import SamplingParams
    spec = http.get("/openapi.json").json()
    schema = spec["components"]["schemas"]["SamplingParams"]
    fields = SamplingParams.model_fields
    assert set(schema["properties"]) == set(fields)
    assert schema.get("additionalProperties") is False
    for name, f in fields.items():
        prop = schema["properties"][name]
        assert prop.get("default") == f.get_default(call_default_factory=True), name
        assert prop.get("description") == f.description, name
    # Every numeric field is bounded on both sides (seed: 0 <= seed < 2**63).
    for name, prop in schema["properties"].items():
        types = [prop] + prop.get("anyOf", [])
        for t in types:
            if t.get("type") in ("integer", "number"):
                assert ("minimum" in t or "exclusiveMinimum" in t) and \
                    ("maximum" in t or "exclusiveMaximum" in t), name
    # And what the API accepts, the engine accepts, with the same normalization.
    body = {"n": 2, "stop": "x", "seed": 3, "top_k": 5, "logprobs": True, "top_logprobs": 4}
    assert SamplingParams(**body).stop == ["x"]


def test_idempotency_key_returns_the_same_job(http):
    body = {"prompts": ["same"], "run_at": later()}
    h = {"Idempotency-Key": "retry-me-" + later()}
    first = http.post("/v1/jobs", json=body, headers=h)
    again = http.post("/v1/jobs", json=body, headers=h)
    assert first.status_code == again.status_code == 202
    assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
    other = http.post("/v1/jobs", json={**body, "prompts": ["different"]}, headers=h)
    assert other.status_code == 409
    http.post(f"/v1/jobs/{first.json()['id']}/cancel")


def test_idempotency_key_claimed_with_the_enqueue_under_concurrency(api_url, api_pair, redis):
    """Twelve concurrent POSTs with one key, over two API processes: one job, one claim, and
    every answer names that job, which exists (claim and enqueue are one transaction)."""
    from concurrent.futures import ThreadPoolExecutor
    body = {"prompts": ["race"], "run_at": later()}
    key = "race-" + later()

    def post(i):
        with httpx.Client(base_url=api_pair[i % 2], timeout=10) as c:
            return c.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(post, range(12)))
    assert {r.status_code for r in answers} == {202}
    ids = {r.json()["id"] for r in answers}
    assert len(ids) == 1
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in answers) == 11
    job_id = ids.pop()
    with httpx.Client(base_url=api_url, timeout=10) as c:
        assert c.get(f"/v1/jobs/{job_id}").json()["status"] == "scheduled"
        c.post(f"/v1/jobs/{job_id}/cancel")


def test_a_failed_enqueue_leaves_no_idempotency_claim(redis, redis_url, tmp_path):
    """The enqueue fails inside the transaction (this API's Redis user may not XADD): the key
    must not be claimed, or a retry would replay a job that never existed."""
    from urllib.parse import urlsplit

    from conftest import start_api
    redis.execute_command("ACL", "SETUSER", "noxadd", "on", ">pw", "~*", "&*", "+@all", "-xadd")
    u = urlsplit(redis_url)
    proc, url = start_api(f"redis://noxadd:pw@{u.hostname}:{u.port}{u.path}", tmp_path, "api-noxadd")
    try:
        key = "fails-" + later()
        with httpx.Client(base_url=url, timeout=10) as c:
            r = c.post("/v1/jobs", json={"prompts": ["a"]}, headers={"Idempotency-Key": key})
        assert r.status_code == 500
        assert redis.get(keys.idempotency(key)) is None
    finally:
        proc.stop()
        redis.execute_command("ACL", "DELUSER", "noxadd")


def test_openapi_documents_every_response(http):
    spec = http.get("/openapi.json").json()
    paths = spec["paths"]
    assert set(paths["/v1/jobs"]["post"]["responses"]) >= {"202", "400", "409", "422"}
    r = http.post("/v1/jobs", content=b'{"prompts": ["\xff"]}', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "detail" in r.json()
    for path in ("/v1/jobs/{job_id}", "/v1/jobs/{job_id}/results", "/v1/jobs/{job_id}/events"):
        assert set(paths[path]["get"]["responses"]) >= {"200", "404", "422"}, path
    assert set(paths["/v1/jobs/{job_id}/cancel"]["post"]["responses"]) >= {"202", "404", "409", "422"}
    assert "text/event-stream" in paths["/v1/jobs/{job_id}/events"]["get"]["responses"]["200"]["content"]
    assert http.get("/healthz").json() == {"status": "ok", "redis": "ok"}
    assert http.get("/health").json() == {"status": "ok", "redis": "ok"}  # the name vLLM's users script
    assert http.get("/version").json() == {"version": spec["info"]["version"]}




def test_shard_settings_out_of_bounds_stop_the_api_naming_them(redis_url):
    import subprocess
    import sys
    for name in ("FANOUT_SHARD_SAMPLES", "FANOUT_SHARD_WINDOW"):
        p = subprocess.run([sys.executable, "-m", "cli.main", "api", "--port", "1", "--redis-url", redis_url],
                           env={**os.environ, name: "0"}, capture_output=True, text=True, timeout=60)
        assert p.returncode != 0 and f"{name}: must be at least 1, got 0" in p.stderr, (p.returncode, p.stderr)


@pytest.mark.parametrize("content,loc", [
    ("bad \ud800", ["body", "messages", 0, 1, "content"]),
    ([{"type": "text", "text": "bad \udfff"}], ["body", "messages", 0, 1, "content", 0, "text"]),
])
def test_a_lone_surrogate_in_a_chat_is_a_422_naming_the_field(http, content, loc):
    """JSON's "\\ud800" escape makes a string no tokenizer takes: refused at the edge, as
    in prompts, not failing the job on a worker."""
    chat = [{"role": "user", "content": "fine"}, {"role": "user", "content": content}]
    raw = json.dumps({"messages": [chat, [{"role": "user", "content": "good"}]]})  # ASCII: \ud800 escaped
    r = http.post("/v1/jobs", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert any(e["loc"] == loc and "lone surrogate" in e["msg"] for e in r.json()["detail"]), r.json()
