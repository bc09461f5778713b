"""Webhooks (api/webhooks.py) against a real receiver on this machine: a job's end POSTed
once and signed (checked with the openai SDK's own verifier), a failed delivery retried, an
OpenAI batch's `batch.completed` unwrapped by the SDK, a tenant default, private addresses
refused, and a delivery due while no API process runs sent once one starts."""
import http.server
import io
import json
import threading
import time

import httpx
import openai
import pytest

from api.webhooks import SCHEDULE, Webhooks
from jobs.settings import Settings

from conftest import start_api, wait_for

SWEEP = 1.0  # the sender's period (api/webhooks.py run)


class Receiver:
    """An HTTP server recording every POST; `answers[path]` lists the status codes to give
    first (then 200)."""

    def __init__(self):
        self.posts: list[tuple[str, dict, bytes]] = []
        self.answers: dict[str, list[int]] = {}
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                outer.posts.append((self.path, dict(self.headers), body))
                codes = outer.answers.get(self.path) or []
                self.send_response(codes.pop(0) if codes else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def at(self, path: str) -> list[tuple[dict, bytes]]:
        return [(h, b) for p, h, b in self.posts if p == path]


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.server.shutdown()


@pytest.fixture(scope="module")
def hooks_api(redis_url, tmp_path_factory, receiver):
    """An API whose webhooks may reach the receiver (named) and any public host (`*`)."""
    logs = tmp_path_factory.mktemp("webhook-logs")
    env = {"FANOUT_WEBHOOK_HOSTS": f"127.0.0.1:{receiver.port},*"}
    proc, url = start_api(redis_url, logs, "api-hooks", env=env)
    yield proc, url, logs, env
    proc.stop()


def _secret(url: str) -> str:
    return httpx.get(url + "/v1/webhooks").json()["secret"]


def _ended(url: str, job_id: str, timeout: float) -> dict:
    info = {}

    def done():
        info.update(httpx.get(f"{url}/v1/jobs/{job_id}").json())
        return info["status"] in ("succeeded", "failed", "canceled")
    wait_for(done, timeout, f"job {job_id} to end")
    return info


def _verify(headers: dict, body: bytes, secret: str) -> dict:
    """The openai SDK's Standard Webhooks check (raises if the signature or timestamp is off)."""
    openai.OpenAI(api_key="unused").webhooks.verify_signature(body, headers, secret=secret)
    return json.loads(body)


def test_a_jobs_end_is_posted_once_signed(hooks_api, receiver, worker):
    _, url, _, _ = hooks_api
    r = httpx.post(url + "/v1/jobs", json={"prompts": ["a", "b"], "webhook_url": receiver.url("/once"),
                                           "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    _ended(url, job_id, 120)
    wait_for(lambda: receiver.at("/once"), 10 + 3 * SWEEP, "the webhook")
    time.sleep(3 * SWEEP)  # sweeps after the delivery send nothing more
    posts = receiver.at("/once")
    assert len(posts) == 1, posts
    headers, body = posts[0]
    event = _verify(headers, body, _secret(url))
    assert headers["webhook-id"] == event["id"] == f"evt_{job_id}"
    assert event["type"] == "job.succeeded" and event["object"] == "event"
    assert event["data"]["id"] == job_id and event["data"]["progress"]["done"] == 2
    with pytest.raises(openai.InvalidWebhookSignatureError):  # the check can fail: another secret
        _verify(headers, body, "whsec_" + "A" * 44)
    hook = httpx.get(f"{url}/v1/jobs/{job_id}").json()["webhook"]
    assert hook == {"url": receiver.url("/once"), "status": "delivered", "attempts": 1, "error": None}


def test_a_failed_delivery_is_retried(hooks_api, receiver, worker):
    _, url, _, _ = hooks_api
    receiver.answers["/flaky"] = [500]
    job_id = httpx.post(url + "/v1/jobs", json={"prompts": ["x"], "webhook_url": receiver.url("/flaky"),
                                                "sampling_params": {"max_new_tokens": 2}}).json()["id"]
    _ended(url, job_id, 120)
    wait_for(lambda: receiver.at("/flaky"), 10 + 3 * SWEEP, "the first delivery")
    pending = httpx.get(f"{url}/v1/jobs/{job_id}").json()["webhook"]
    wait_for(lambda: len(receiver.at("/flaky")) == 2, SCHEDULE[0] + 10 * SWEEP, "the retry")
    first, second = receiver.at("/flaky")
    assert first[0]["webhook-id"] == second[0]["webhook-id"] == f"evt_{job_id}"  # one event, to deduplicate
    assert int(second[0]["webhook-timestamp"]) >= int(first[0]["webhook-timestamp"])
    _verify(*second, _secret(url))
    assert pending["status"] in ("pending", "delivered")
    hook = httpx.get(f"{url}/v1/jobs/{job_id}").json()["webhook"]
    assert hook["status"] == "delivered" and hook["attempts"] == 2, hook


def test_private_addresses_and_unlisted_hosts_are_refused(hooks_api, receiver):
    _, url, _, _ = hooks_api
    for target, why in [("http://127.0.0.1/hook", "not a public address"),
                        ("http://10.1.2.3/hook", "not a public address"),
                        ("http://169.254.169.254/latest", "not a public address"),
                        ("http://[::1]/hook", "not a public address"),
                        (f"http://127.0.0.1:{receiver.port + 1}/hook", "is not among the allowed hosts"),
                        ("ftp://example.com/x", "not an http(s) URL")]:
        r = httpx.post(url + "/v1/jobs", json={"prompts": ["x"], "webhook_url": target})
        assert r.status_code == 422, (target, r.text)
        detail = r.json()["detail"][0]
        assert detail["loc"] == ["body", "webhook_url"] and why in detail["msg"], (target, detail)
        r = httpx.put(url + "/v1/webhooks", json={"url": target})
        assert r.status_code == 422 and why in r.text, (target, r.text)
    off = Webhooks(None, Settings())  # no FANOUT_WEBHOOK_HOSTS: webhooks are off
    with pytest.raises(Exception, match="webhooks are off on this server.*FANOUT_WEBHOOK_HOSTS"):
        off.check("https://example.com/hook")


def test_a_batch_end_is_an_openai_event(hooks_api, receiver, worker):
    _, url, _, _ = hooks_api
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "llama", "prompt": f"p{i}", "max_tokens": 2}} for i in range(3)]
    f = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())),
                            purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                                  extra_body={"webhook_url": receiver.url("/batch")})
    wait_for(lambda: receiver.at("/batch"), 180, "the batch's webhook")
    headers, body = receiver.at("/batch")[0]
    event = client.webhooks.unwrap(body, headers, secret=_secret(url))
    assert event.type == "batch.completed" and event.data.id == batch.id
    assert client.batches.retrieve(batch.id).status == "completed"
    assert len(receiver.at("/batch")) == 1


def test_the_default_webhook_and_a_delivery_due_while_no_api_runs(hooks_api, receiver, worker, redis_url):
    """PUT /v1/webhooks sets the default of jobs that name none; a job that ends while no API
    process runs has its delivery kept in Redis and sent when one starts."""
    proc, url, logs, env = hooks_api
    r = httpx.put(url + "/v1/webhooks", json={"url": receiver.url("/default")})
    assert r.status_code == 200 and r.json()["url"] == receiver.url("/default"), r.text
    try:
        job_id = httpx.post(url + "/v1/jobs", json={"prompts": ["x"] * 4,
                                                    "sampling_params": {"max_new_tokens": 24}}).json()["id"]
    finally:
        assert httpx.put(url + "/v1/webhooks", json={"url": None}).json()["url"] is None
    proc.stop()  # no API sends anything now (the others of this Redis have webhooks off)
    import redis as redis_lib
    from results import keys
    r = redis_lib.Redis.from_url(redis_url)
    wait_for(lambda: r.get(keys.closed(job_id)), 120, "the job to end on the worker")
    assert r.zscore(keys.webhooks(), f"job:{job_id}") is not None  # due, in the outbox
    assert not receiver.at("/default")
    again, url2 = start_api(redis_url, logs, "api-hooks-2", env=env)
    try:
        wait_for(lambda: receiver.at("/default"), 10 + 3 * SWEEP, "the delivery after the restart")
        event = _verify(*receiver.at("/default")[0], _secret(url2))
        assert event["id"] == f"evt_{job_id}" and event["type"] == "job.succeeded"
        assert r.zscore(keys.webhooks(), f"job:{job_id}") is None
    finally:
        again.stop()
