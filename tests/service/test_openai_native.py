"""Issue 10 on the native API: items' custom_id on results and stream entries, GET /v1/jobs,
and the model that ran a job. Real API, worker and Redis."""
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from results import reader


@pytest.fixture
def http(api_url):
    with httpx.Client(base_url=api_url, timeout=10) as c:
        yield c


def test_custom_ids_come_back_on_results_and_every_stream_entry(client, redis):
    job = client.submit(prompts=["Hello", "def f(x):", "import os"], custom_ids=["a", None, "c"],
                        sampling_params={"max_new_tokens": 5, "n": 2})
    entries = [e for _, e in reader.follow(redis, job["id"], timeout=60)]
    per_item = [e for e in entries if e["type"] in ("delta", "final", "error")]
    assert {e["index"] for e in per_item} == {0, 1, 2}
    for e in per_item:
        assert e.get("custom_id") == {0: "a", 1: None, 2: "c"}[e["index"]], e
    items = client.results(job["id"])
    assert [(it["index"], it["custom_id"], len(it["samples"])) for it in items] == [(0, "a", 2), (1, None, 2),
                                                                                   (2, "c", 2)]
    info = client.status(job["id"])
    assert info["status"] == "succeeded" and info["model"] == "llama"  # the model folder's name


@pytest.mark.parametrize("custom_ids, msg", [(["a", "a"], "unique"), (["a"], "1 for 2 items"), (["a", ""], "at least 1")])
def test_bad_custom_ids_get_a_422(http, custom_ids, msg):
    r = http.post("/v1/jobs", json={"prompts": ["x", "y"], "custom_ids": custom_ids})
    assert r.status_code == 422, r.text
    assert msg in r.text


def test_jobs_are_listed_newest_first_with_a_cursor_and_a_status_filter(http):
    later = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
    ids = [http.post("/v1/jobs", json={"prompts": ["x"], "run_at": later}).json()["id"] for _ in range(3)]
    try:
        first = http.get("/v1/jobs", params={"limit": 2}).json()
        assert [j["id"] for j in first["data"]] == ids[::-1][:2] and first["has_more"]
        assert first["last_id"] == ids[1] and first["data"][0]["status"] == "scheduled"
        second = http.get("/v1/jobs", params={"limit": 2, "after": first["last_id"]}).json()
        assert second["data"][0]["id"] == ids[0]
        scheduled = http.get("/v1/jobs", params={"status": "scheduled", "limit": 100}).json()
        assert set(ids) <= {j["id"] for j in scheduled["data"]}
        assert {j["status"] for j in scheduled["data"]} == {"scheduled"}
        succeeded = http.get("/v1/jobs", params={"status": "succeeded", "limit": 100}).json()
        assert not set(ids) & {j["id"] for j in succeeded["data"]}
        r = http.get("/v1/jobs", params={"after": "no-such-job"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "after"]
    finally:
        # A fresh connection: in the full suite (only there) the server has reset the one
        # that carried the 422 above; not understood yet, named in the stop-13 closing note.
        with httpx.Client(base_url=str(http.base_url), timeout=10) as fresh:
            for job_id in ids:
                fresh.post(f"/v1/jobs/{job_id}/cancel")


def test_each_status_lists_from_its_index_through_every_change(http, worker, redis):
    """A job is in the index of its status and no other, from its submit to its end (queued,
    scheduled, running, succeeded, canceled); a status's pages are newest first, each job
    once, also when jobs change status between pages."""
    from results import keys

    def listed(status, limit=100):
        out, after = [], None
        while True:
            page = http.get("/v1/jobs", params={"status": status, "limit": limit,
                                                **({"after": after} if after else {})}).json()
            out += [j["id"] for j in page["data"]]
            if not page["has_more"]:
                return out
            after = page["last_id"]

    def indexed(job_id):
        return [s for s in ("queued", "scheduled", "running", "succeeded", "failed", "canceled")
                if redis.zscore(keys.by_status(keys.jobs(None), s), job_id) is not None]

    later = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
    scheduled = http.post("/v1/jobs", json={"prompts": ["x"], "run_at": later}).json()["id"]
    slow = http.post("/v1/jobs", json={"prompts": ["y"], "sampling_params": {"max_new_tokens": 900,
                                                                              "ignore_eos": True}}).json()["id"]
    quick = [http.post("/v1/jobs", json={"prompts": [f"q{i}"], "sampling_params": {"max_new_tokens": 2}}).json()["id"]
             for i in range(5)]
    assert indexed(scheduled) == ["scheduled"]
    deadline = time.monotonic() + 60
    while indexed(slow) != ["running"] or any(indexed(q) != ["succeeded"] for q in quick):
        assert time.monotonic() < deadline, (indexed(slow), [indexed(q) for q in quick])
        time.sleep(0.05)
    done = listed("succeeded", limit=2)  # pages of two
    assert [q for q in done if q in quick] == quick[::-1] and len(done) == len(set(done))
    assert slow in listed("running") and scheduled in listed("scheduled")
    http.post(f"/v1/jobs/{slow}/cancel")
    http.post(f"/v1/jobs/{scheduled}/cancel")
    while indexed(slow) != ["canceled"]:
        assert time.monotonic() < deadline, indexed(slow)
        time.sleep(0.05)
    assert indexed(scheduled) == ["canceled"]
    assert {slow, scheduled} <= set(listed("canceled")) and slow not in listed("running")
