"""API keys and tenants, on a Redis of their own (keys switch auth on for every client of a
Redis, so the other tests' shared one must never see one): open mode until a key exists,
the `fanout keys` commands as an operator runs them, 401 without a valid key, isolation on
every job route, idempotency keys per tenant, the high-priority right and each limit (429)."""
import json
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import redis as redis_lib

from api import tenants
from conftest import WorkerProc, fanout, http, later, start_api, wait_for
from results.client import Client
from cli.redis_server import EmbeddedRedis

JOB = {"prompts": ["a b c"], "sampling_params": {"max_new_tokens": 4}}


def test_open_mode_until_a_key_exists_then_the_keys_commands(tmp_path):
    server = EmbeddedRedis()
    proc, url = start_api(server.url, tmp_path, "api-open", env={"FANOUT_MODELS": "llama"})  # no worker
    try:
        with open(proc.log_path) as f:
            assert "no API keys: every client sees every job" in f.read()
        with http(url) as anyone:
            open_job = anyone.post("/v1/jobs", json={**JOB, "run_at": later()}).json()["id"]
            assert anyone.get(f"/v1/jobs/{open_job}").status_code == 200

            created = fanout("keys", "create", "--name", "ci", "--jobs-in-flight", "5", "--redis-url", server.url)
            assert created.returncode == 0, created.stderr
            key = created.stdout.strip()
            assert key.startswith("fo_") and "shown only now" in created.stderr

            # Auth is on: every job route needs a key; health and the docs stay open.
            for method, path in [("POST", "/v1/jobs"), ("GET", f"/v1/jobs/{open_job}"),
                                 ("GET", f"/v1/jobs/{open_job}/results"), ("GET", f"/v1/jobs/{open_job}/events"),
                                 ("POST", f"/v1/jobs/{open_job}/cancel")]:
                r = anyone.request(method, path, json=JOB if method == "POST" else None)
                assert r.status_code == 401, (path, r.text)
                assert r.json()["detail"].startswith("missing API key") and r.headers["www-authenticate"] == "Bearer"
            for path in ("/healthz", "/openapi.json", "/docs"):
                assert anyone.get(path).status_code == 200, path
            bad = anyone.get(f"/v1/jobs/{open_job}", headers={"Authorization": "Bearer fo_nope"})
            assert bad.status_code == 401 and bad.json()["detail"].startswith("invalid API key")

        with http(url, key) as tenant:
            job = tenant.post("/v1/jobs", json={**JOB, "run_at": later()})
            assert job.status_code == 202, job.text
            # A job from open mode has no owner: no tenant sees it.
            assert tenant.get(f"/v1/jobs/{open_job}").status_code == 404
        status = fanout("status", job.json()["id"], "--url", url, "--api-key", key)
        assert status.returncode == 0 and json.loads(status.stdout)["status"] == "scheduled", status.stderr

        listed = fanout("keys", "list", "--redis-url", server.url)
        assert listed.returncode == 0, listed.stderr
        assert key not in listed.stdout and tenants.digest(key) not in listed.stdout
        [row] = [json.loads(line) for line in listed.stdout.splitlines()]
        assert row["name"] == "ci" and row["revoked"] is False and row["limits"] == {"jobs_in_flight": 5}
        assert row["in_flight"] == 1 and row["may_use_high_priority"] is False

        revoked = fanout("keys", "revoke", row["id"], "--redis-url", server.url)
        assert revoked.returncode == 0 and json.loads(revoked.stdout)["revoked"] is True, revoked.stderr
        with http(url, key) as tenant:
            r = tenant.get(f"/v1/jobs/{job.json()['id']}")
            assert r.status_code == 401 and r.json()["detail"].startswith("revoked API key")
        # Revoking the last key does not reopen the service.
        with http(url) as anyone:
            assert anyone.get(f"/v1/jobs/{open_job}").status_code == 401
        unknown = fanout("keys", "revoke", "nosuchid", "--redis-url", server.url)
        assert unknown.returncode != 0 and unknown.stderr.strip() == "fanout keys: no API key with id nosuchid"
    finally:
        proc.stop()
        server.stop()


@pytest.fixture(scope="module")
def service(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tenants")
    server = EmbeddedRedis()
    conn = redis_lib.Redis.from_url(server.url)
    api = worker = None
    try:
        api, url = start_api(server.url, logs, "api-tenants")
        worker = WorkerProc(server.url, model_dir, logs)
        worker.start()
        yield SimpleNamespace(url=url, redis=conn, key=lambda **kw: tenants.create(conn, **kw))
    finally:
        for p in (worker, api):
            if p is not None and p.proc is not None:
                p.stop()
        conn.close()
        server.stop()


def test_a_tenant_sees_only_its_own_jobs(service):
    a_key, a = service.key(name="a", limits={})
    b_key, _ = service.key(name="b", limits={})
    with Client(service.url, api_key=a_key) as client:
        job = client.submit(JOB)["id"]
        assert list(client.events(job, timeout=60))[-1][1]["status"] == "succeeded"
        assert client.results(job)[0]["samples"][0]["finish_reason"] in ("length", "stop")
    # Its slot is given back when the worker ends it.
    wait_for(lambda: tenants.in_flight(service.redis, a.id) == 0, 10, "the in-flight count to drop")

    with http(service.url, b_key) as b:
        for method, path in [("GET", "/v1/jobs/{}"), ("GET", "/v1/jobs/{}/results"),
                             ("GET", "/v1/jobs/{}/events"), ("POST", "/v1/jobs/{}/cancel")]:
            theirs, unknown = (b.request(method, path.format(j)) for j in (job, "0" * 32))
            assert theirs.status_code == unknown.status_code == 404, path
            assert theirs.json() == {"detail": f"job not found: {job}"}, path
        listing = b.get("/v1/jobs")
        assert listing.status_code == 200 and job not in listing.text
        theirs, unknown = (b.get("/v1/jobs", params={"after": j}) for j in (job, "0" * 32))
        assert theirs.status_code == unknown.status_code == 422
        assert theirs.text.replace(job, "0" * 32) == unknown.text
    with http(service.url, a_key) as client:
        assert job in [j["id"] for j in client.get("/v1/jobs").json()["data"]]


def test_idempotency_keys_are_per_tenant(service):
    keys = [service.key(name=f"idem{i}", limits={})[0] for i in range(2)]
    body, headers = {**JOB, "run_at": later()}, {"Idempotency-Key": "nightly-1"}
    ids = []
    for key in keys:
        with http(service.url, key) as c:
            r = c.post("/v1/jobs", json=body, headers=headers)
            assert r.status_code == 202 and "idempotent-replayed" not in r.headers
            again = c.post("/v1/jobs", json=body, headers=headers)
            assert again.json()["id"] == r.json()["id"] and again.headers["idempotent-replayed"] == "true"
            ids.append(r.json()["id"])
            c.post(f"/v1/jobs/{ids[-1]}/cancel")
    assert ids[0] != ids[1]


def test_high_priority_needs_the_right(service):
    plain, _ = service.key(name="plain", limits={})
    vip, _ = service.key(name="vip", limits={}, may_use_high_priority=True)
    body = {**JOB, "priority": "high", "run_at": later()}
    with http(service.url, plain) as c:
        r = c.post("/v1/jobs", json=body)
        assert r.status_code == 403 and r.json() == {"detail": "priority: high is not allowed for this API key"}
        assert c.post("/v1/jobs", json={**body, "priority": "normal"}).status_code == 202
    with http(service.url, vip) as c:
        assert c.post("/v1/jobs", json=body).status_code == 202


def over(r, limit):
    # Retry-After only where waiting helps: the per-second window (exact), a slot or room
    # that frees as jobs end or files go; never for a job too big for the key.
    retry = {"requests_per_second": "1", "jobs_in_flight": "5", "file_bytes": "5"}.get(limit)
    retry = r.headers.get("Retry-After") == retry
    return r.status_code == 429 and r.json()["limit"] == limit and limit in r.json()["detail"] and retry


def test_each_limit_answers_429(service):
    key, tenant = service.key(name="small", limits={"items_per_job": 2, "tokens_per_job": 100, "jobs_in_flight": 3})
    scheduled = {"run_at": later(), "sampling_params": {"max_new_tokens": 10}}
    with http(service.url, key) as c:
        assert over(c.post("/v1/jobs", json={**scheduled, "prompts": ["a", "b", "c"]}), "items_per_job")
        # 10 x 2 + 40 x 2 = 100 tokens is the limit; one more is over it.
        per_item = [{"max_new_tokens": 10, "n": 2}, {"max_new_tokens": 40, "n": 2}]
        assert c.post("/v1/jobs", json={**scheduled, "prompts": ["a", "b"], "sampling_params": per_item}
                      ).status_code == 202
        per_item[1]["max_new_tokens"] = 41
        assert over(c.post("/v1/jobs", json={**scheduled, "prompts": ["a", "b"], "sampling_params": per_item}),
                    "tokens_per_job")

        # One slot is taken; 8 submits at once get exactly the 2 left.
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: c.post("/v1/jobs", json={**scheduled, "prompts": ["a"]}), range(8)))
        accepted = [r.json()["id"] for r in answers if r.status_code == 202]
        assert len(accepted) == 2 and sum(over(r, "jobs_in_flight") for r in answers) == 6
        assert tenants.in_flight(service.redis, tenant.id) == 3
        # A canceled job gives its slot back.
        assert c.post(f"/v1/jobs/{accepted[0]}/cancel").json()["status"] == "canceled"
        assert tenants.in_flight(service.redis, tenant.id) == 2
        assert c.post("/v1/jobs", json={**scheduled, "prompts": ["a"]}).status_code == 202


def test_a_dataset_job_holds_its_slot_while_it_validates(service):
    """A dataset job counts as in flight from its POST: while its lines are being checked a
    second job is over the limit; a cancel, or a validation that fails, gives the slot back."""
    key, tenant = service.key(name="datasets", limits={"jobs_in_flight": 1})
    lines = "".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(30_000))
    bad = lines + '{"prompt": 7}\n'
    with http(service.url, key) as c:
        ids = [c.post("/v1/files", files={"file": ("rows.jsonl", body.encode())}, data={"purpose": "dataset"}
                      ).json()["id"] for body in (lines, bad)]
        first = c.post("/v1/jobs", json={"input_file_id": ids[0], "run_at": later()}).json()
        assert first["status"] == "validating"
        assert over(c.post("/v1/jobs", json={**JOB, "run_at": later()}), "jobs_in_flight")
        assert c.get(f"/v1/jobs/{first['id']}").json()["status"] == "validating"  # (it was, at the 429)
        assert tenants.in_flight(service.redis, tenant.id) == 1
        assert c.post(f"/v1/jobs/{first['id']}/cancel").json()["status"] == "canceled"
        assert tenants.in_flight(service.redis, tenant.id) == 0
        failing = c.post("/v1/jobs", json={"input_file_id": ids[1]}).json()
        info = wait_for(lambda: (j := c.get(f"/v1/jobs/{failing['id']}").json())["status"] != "validating" and j,
                        60, "the validation to end")
        assert info["status"] == "failed" and "line 30001" in info["error"], info
        assert tenants.in_flight(service.redis, tenant.id) == 0


def test_requests_per_second_answers_429(service):
    key, _ = service.key(name="chatty", limits={"requests_per_second": 3})
    with http(service.url, key) as c:
        answers = [c.get(f"/v1/jobs/{'0' * 32}") for _ in range(12)]
        # 12 requests within at most two one-second windows: 6 pass at most.
        assert {r.status_code for r in answers} == {404, 429}
        assert sum(over(r, "requests_per_second") for r in answers) >= 6
        time.sleep(1.1)
        assert c.get(f"/v1/jobs/{'0' * 32}").status_code == 404


def test_requests_per_second_allows_no_double_burst_across_a_second(service):
    """A burst of the limit just before a second's boundary and another just after: a fixed
    window would pass both; the rate passes the first and only what the time between earns."""
    key, _ = service.key(name="bursty", limits={"requests_per_second": 5})
    with http(service.url, key) as c:
        time.sleep(1.85 - time.time() % 1)  # 0.85 s into a second (the API's and this clock)
        t0 = time.monotonic()
        first = [c.get(f"/v1/jobs/{'0' * 32}").status_code for _ in range(5)]
        time.sleep(max(0.0, 1.05 - time.time() % 1) if time.time() % 1 > 0.5 else 0.05)  # past it
        second = [c.get(f"/v1/jobs/{'0' * 32}").status_code for _ in range(5)]
        elapsed = time.monotonic() - t0
    assert first == [404] * 5
    assert second.count(404) <= 1 + int(elapsed * 5), (second, elapsed)
    assert second.count(429) >= 2, second


def test_file_bytes_bounds_what_a_key_keeps_in_files(service):
    """A key with file_bytes: uploads pass while its kept files fit, the next one is a 429
    naming the limit (exact under concurrent uploads), and deleting a file frees its bytes."""
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "llama", "messages": [{"role": "user", "content": "x" * 400}]}}) + "\n"
    size = len(line.encode())
    key, _ = service.key(name="files", limits={"file_bytes": 3 * size})

    def upload(c):
        return c.post("/v1/files", files={"file": ("in.jsonl", line.encode())}, data={"purpose": "batch"})

    with http(service.url, key) as c:
        first = upload(c)
        assert first.status_code == 200, first.text
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: upload(c), range(6)))
        assert sum(r.status_code == 200 for r in answers) == 2
        refused = [r for r in answers if r.status_code == 429]
        assert len(refused) == 4 and all(r.json()["error"]["code"] == "file_bytes" for r in refused)
        assert "file_bytes" in refused[0].json()["error"]["message"]
        assert all(r.headers["Retry-After"] == "5" for r in refused)  # room frees as files go
        assert c.delete(f"/v1/files/{first.json()['id']}").status_code == 200
        assert upload(c).status_code == 200


def test_anthropic_clients_send_the_key_as_x_api_key_and_see_only_their_batches(service):
    import anthropic

    a_key, _ = service.key(name="claude-a", limits={})
    b_key, _ = service.key(name="claude-b", limits={})
    with anthropic.Anthropic(base_url=service.url, api_key=a_key, max_retries=0, timeout=60) as a:
        msg = a.messages.create(model="llama", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert msg.type == "message"
        batch = a.messages.batches.create(requests=[{"custom_id": "one", "params": {
            "model": "llama", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}}])
    with anthropic.Anthropic(base_url=service.url, api_key=b_key, max_retries=0, timeout=60) as b:
        with pytest.raises(anthropic.NotFoundError):
            b.messages.batches.retrieve(batch.id)
        assert batch.id not in [x.id for x in b.messages.batches.list().data]
    with anthropic.Anthropic(base_url=service.url, api_key="fo_wrong", max_retries=0, timeout=60) as nobody:
        with pytest.raises(anthropic.AuthenticationError) as e:
            nobody.messages.create(model="llama", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"]["type"] == "authentication_error"
