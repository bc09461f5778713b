"""Native datasets: a job naming a file of items (POST /v1/files purpose `dataset`, then
POST /v1/jobs `input_file_id`) runs as the same items in a body would, past the body's item
cap, with its items in the blob store; bad lines are named."""
import json
import os
import re
import time

import httpx
import pytest

from conftest import entries, wait_for
from results import keys


def upload(api_url, lines, purpose="dataset") -> str:
    data = "".join((x if isinstance(x, str) and x.startswith("!") else json.dumps(x)).lstrip("!") + "\n"
                   for x in lines).encode()
    r = httpx.post(api_url + "/v1/files", files={"file": ("items.jsonl", data)}, data={"purpose": purpose})
    assert r.status_code == 200, r.text
    assert r.json()["purpose"] == purpose
    return r.json()["id"]


def finished(api_url, job_id, timeout=120) -> list[dict]:
    wait_for(lambda: httpx.get(f"{api_url}/v1/jobs/{job_id}").json()["status"] in ("succeeded", "failed"),
             timeout, "the job to end")
    info = httpx.get(f"{api_url}/v1/jobs/{job_id}").json()
    assert info["status"] == "succeeded", info
    return httpx.get(f"{api_url}/v1/jobs/{job_id}/results", params={"limit": 1000}).json()["items"]


def test_a_dataset_job_runs_as_the_same_items_in_a_body(api_url, worker, redis, storage_dir):
    prompts = [f"dataset line {i}" for i in range(100)]  # past FANOUT_MAX_BATCH (64 here): no cap for a file
    own = {"n": 2, "temperature": 0.8, "seed": 3}
    lines = [{"prompt": p, "custom_id": f"c{i}", **({"sampling_params": own} if i == 7 else {})}
             for i, p in enumerate(prompts)]
    file_id = upload(api_url, lines)
    shared = {"max_new_tokens": 4, "temperature": 0}
    r = httpx.post(api_url + "/v1/jobs", json={"input_file_id": file_id, "sampling_params": shared, "seed": 5})
    job = validated(api_url, r)
    assert job["progress"]["total"] == 100 and job["seed"] == 5
    got = finished(api_url, job["id"])
    assert [it["custom_id"] for it in got] == [f"c{i}" for i in range(100)]
    assert [len(it["samples"]) for it in got] == [2 if i == 7 else 1 for i in range(100)]
    assert not redis.exists(keys.items(job["id"]))
    assert os.listdir(storage_dir / "jobs" / job["id"] / "items")
    # Redis keeps what coordinates work, not the rows: each done shard's results went to the
    # store, its stream entries were trimmed, its counters dropped; nor do the custom ids.
    shards = int(redis.hget(keys.info(job["id"]), "shards"))
    assert shards >= 2
    assert not redis.exists(keys.results(job["id"])) and not redis.exists(keys.custom_ids(job["id"]))
    assert redis.bitcount(keys.kept(job["id"])) == shards
    assert sorted(os.listdir(storage_dir / "jobs" / job["id"] / "results")) == sorted(f"{k}.jsonl" for k in range(shards))
    assert not [f for f in redis.hkeys(keys.shards(job["id"])) if f.startswith((b"claims:", b"strikes:"))]
    left = [e for _, e in redis.xrange(keys.stream(job["id"]))]
    assert len(left) < 10 and left[-1][b"status"] == b"succeeded", left
    # A follower from the start is told that entries are gone, and where the items are.
    with httpx.stream("GET", f"{api_url}/v1/jobs/{job['id']}/events", timeout=30) as r:
        seen = [(line[4:], json.loads(data[6:])) for line, data in
                zip(*[iter([x for x in r.iter_lines() if x.startswith(("id: ", "data: "))])] * 2)]
    trimmed = redis.hget(keys.info(job["id"]), "trimmed").decode()
    assert seen[0] == (trimmed, {"type": "trimmed", "through": trimmed, "results": f"/v1/jobs/{job['id']}/results"})
    assert seen[-1][1]["status"] == "succeeded"
    # Resumed after that event: nothing said twice.
    with httpx.stream("GET", f"{api_url}/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": trimmed},
                      timeout=30) as r:
        again = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
    assert [e["type"] for e in again] == [e["type"] for _, e in seen[1:]]
    # The same items in bodies (64 at most per body): the same samples, the sampled line's too.
    params = [{**shared, **(own if i == 7 else {})} for i in range(100)]
    for lo in (0, 50):
        body = {"prompts": prompts[lo:lo + 50], "sampling_params": params[lo:lo + 50], "seed": 5}
        ref = finished(api_url, httpx.post(api_url + "/v1/jobs", json=body).json()["id"])
        for i, it in enumerate(ref):
            if lo + i != 7:  # greedy: the same whatever the index
                assert it["samples"][0]["token_ids"] == got[lo + i]["samples"][0]["token_ids"]
            else:  # its own seed: the same samples wherever it sits
                assert [s["token_ids"] for s in it["samples"]] == [s["token_ids"] for s in got[7]["samples"]]


def test_a_waiting_dataset_jobs_results_name_its_items(api_url, worker, redis):
    """Items of shards not done yet: their custom ids from the store, no samples."""
    file_id = upload(api_url, [{"prompt": f"later {i}", "custom_id": f"w{i}"} for i in range(70)])
    r = httpx.post(api_url + "/v1/jobs", json={"input_file_id": file_id, "run_at": "2099-01-01T00:00:00Z"})
    job_id = validated(api_url, r)["id"]
    assert httpx.get(f"{api_url}/v1/jobs/{job_id}").json()["status"] == "scheduled"
    page = httpx.get(f"{api_url}/v1/jobs/{job_id}/results", params={"offset": 60, "limit": 20}).json()
    assert [(it["index"], it["custom_id"], it["samples"]) for it in page["items"]] == \
        [(i, f"w{i}", []) for i in range(60, 70)]
    assert page["next_offset"] is None
    assert httpx.post(f"{api_url}/v1/jobs/{job_id}/cancel").status_code == 202


def test_a_parquet_dataset_by_url_comes_out_as_parquet_in_order(api_url, worker, input_root, engine):
    """Parquet in (input_url, file:// under FANOUT_INPUT_ROOT), Parquet out (GET /output):
    rows in order, each with its custom id, a row the model cannot take failing alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from worker.engine import SamplingParams
    ids = [engine.tokenizer.encode(f"parquet row {i}") for i in range(40)]
    ids[13] = [10 ** 9]  # outside the vocabulary: this item alone fails
    pq.write_table(pa.table({"input_ids": ids, "custom_id": [f"p{i}" for i in range(40)]}),
                   input_root / "rows.parquet", row_group_size=16)
    r = httpx.post(api_url + "/v1/jobs", json={"input_url": f"file://{input_root}/rows.parquet",
                                              "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    finished(api_url, job_id)
    got = httpx.get(f"{api_url}/v1/jobs/{job_id}/output")  # Parquet in: Parquet out
    assert got.status_code == 200 and got.headers["content-type"] == "application/vnd.apache.parquet"
    out = pq.read_table(pa.BufferReader(got.content)).to_pylist()
    assert [(row["index"], row["custom_id"]) for row in out] == [(i, f"p{i}") for i in range(40)]
    assert out[13]["samples"][0]["finish_reason"] == "error"
    ref = engine.generate(input_ids=[x for i, x in enumerate(ids) if i != 13],
                          sampling_params=SamplingParams(max_new_tokens=3, temperature=0))
    assert [row["samples"][0]["token_ids"] for i, row in enumerate(out) if i != 13] == \
        [x.samples[0].token_ids for x in ref]
    # The same as JSONL, one item per line as /results pages them.
    lines = httpx.get(f"{api_url}/v1/jobs/{job_id}/output", params={"format": "jsonl"}).text.splitlines()
    assert [json.loads(x)["custom_id"] for x in lines] == [f"p{i}" for i in range(40)]
    # A bad row of a Parquet file is named as a line is.
    pq.write_table(pa.table({"prompt": ["fine", "", "fine too"]}), input_root / "bad.parquet")
    job = validated(api_url, httpx.post(api_url + "/v1/jobs", json={"input_url": f"file://{input_root}/bad.parquet"}))
    assert job["status"] == "failed" and [e["loc"] for e in job["errors"]] == [["body", "input_url", 2, "prompt"]], job


@pytest.mark.parametrize("case", ["outside the root", "climbing out", "missing", "s3 with a local store", "ftp",
                                  "both"])
def test_input_url_refusals_name_the_field(api_url, worker, input_root, tmp_path, case):
    (tmp_path / "x.jsonl").write_text('{"prompt": "hi"}\n')
    url = {"outside the root": f"file://{tmp_path}/x.jsonl", "climbing out": f"file://{input_root}/../x.jsonl",
           "missing": f"file://{input_root}/nope.jsonl", "s3 with a local store": "s3://bucket/x.jsonl",
           "ftp": "ftp://host/x.jsonl", "both": f"file://{input_root}/rows.parquet"}[case]
    body = {"input_url": url, **({"input_file_id": "file-x"} if case == "both" else {})}
    r = httpx.post(api_url + "/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"][0]
    want = {"outside the root": "not under FANOUT_INPUT_ROOT", "climbing out": "not under FANOUT_INPUT_ROOT",
            "missing": "cannot read it", "s3 with a local store": "not in the configured blob store",
            "ftp": "give s3://bucket/key", "both": "not both"}[case]
    assert want in detail["msg"], detail
    if case != "both":
        assert detail["loc"] == ["body", "input_url"]


def validated(api_url, r) -> dict:
    """The job of a dataset POST once it has left `validating`."""
    assert r.status_code == 202 and r.json()["status"] == "validating" and r.json()["items"] is None, r.text
    job_id = r.json()["id"]
    return wait_for(lambda: (j := httpx.get(f"{api_url}/v1/jobs/{job_id}").json())["status"] != "validating" and j,
                    60, "the validation to end")


def test_bad_lines_fail_the_job_naming_them(api_url, worker, redis):
    lines = [{"prompt": "fine"}, "!{not json", {"prompt": ""}, {"prompt": "x", "sampling_params": {"top_p": 7}},
             {"prompt": "x", "sampling_params": {"max_new_tokens": 5000}}, {"prompt": "x", "custom_id": "a"},
             {"prompt": "y", "custom_id": "a"}, {"input_ids": [1, 2]}, {"prompt": "x", "extra": 1},
             # After line 1, lines with its sampling_params take the fast path: their errors the same.
             {"prompt": "x", "custom_id": "c" * 513}, {"prompt": 5}]
    file_id = upload(api_url, lines)
    job = validated(api_url, httpx.post(api_url + "/v1/jobs", json={"input_file_id": file_id}))
    assert job["status"] == "failed" and job["progress"]["total"] == 0, job
    errors = {tuple(e["loc"][:3]): e for e in job["errors"]}
    assert set(errors) == {("body", "input_file_id", n) for n in (2, 3, 4, 5, 7, 8, 9, 10, 11)}, job
    assert errors[("body", "input_file_id", 3)]["loc"][3:] == ["prompt"]
    assert errors[("body", "input_file_id", 4)]["loc"][3:] == ["sampling_params", "top_p"]
    assert "FANOUT_MAX_NEW_TOKENS" in errors[("body", "input_file_id", 5)]["msg"]
    assert "used by an earlier line" in errors[("body", "input_file_id", 7)]["msg"]
    assert "same field as the first" in errors[("body", "input_file_id", 8)]["msg"]
    assert errors[("body", "input_file_id", 9)]["loc"][3:] == ["extra"]
    assert errors[("body", "input_file_id", 10)]["loc"][3:] == ["custom_id"]
    assert errors[("body", "input_file_id", 11)]["loc"][3:] == ["prompt"]
    assert job["error"].startswith("the dataset has errors (9): line 2: line: not JSON"), job["error"]
    assert "line 3: prompt: " in job["error"]
    # Nothing of it is queued or left to run; its stream says what happened, in order.
    assert not redis.exists(keys.shards(job["id"])) and not redis.sismember(keys.validating(), job["id"])
    assert [e["status"] for e in entries(redis, job["id"])] == ["validating", "failed"]
    listed = httpx.get(api_url + "/v1/jobs", params={"status": "failed", "limit": 100}).json()["data"]
    assert job["id"] in [j["id"] for j in listed]


def test_a_validating_job_is_listed_so_and_can_be_canceled(api_url, worker, redis, input_root):
    """A big file: its job is `validating` (listed so) while the lines are read; canceled
    then, it is never queued."""
    with open(input_root / "big.jsonl", "w") as f:
        for i in range(200_000):
            f.write(json.dumps({"prompt": f"big {i}"}) + "\n")
    r = httpx.post(api_url + "/v1/jobs", json={"input_url": f"file://{input_root}/big.jsonl"})
    assert r.status_code == 202 and r.json()["status"] == "validating", r.text
    job_id = r.json()["id"]
    listed = httpx.get(api_url + "/v1/jobs", params={"status": "validating"}).json()["data"]
    assert job_id in [j["id"] for j in listed]
    assert httpx.post(f"{api_url}/v1/jobs/{job_id}/cancel").json()["status"] == "canceled"
    wait_for(lambda: not redis.sismember(keys.validating(), job_id), 120, "the validation to stop")
    assert httpx.get(f"{api_url}/v1/jobs/{job_id}").json()["status"] == "canceled"
    assert not redis.exists(keys.shards(job_id))
    assert [e["status"] for e in entries(redis, job_id) if e["type"] == "status"] == ["validating", "canceled"]


@pytest.mark.parametrize("case", ["unknown", "batch purpose", "items too"])
def test_input_file_id_refusals_name_the_field(api_url, worker, case):
    body = {"input_file_id": "file-nope"}
    if case == "batch purpose":
        line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "llama", "prompt": "x"}}
        body["input_file_id"] = upload(api_url, [line], purpose="batch")
    if case == "items too":
        body["prompts"] = ["a"]
    r = httpx.post(api_url + "/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    (e,) = r.json()["detail"]
    assert e["loc"][:2] == ["body", "input_file_id"] or "input_file_id" in e["msg"], e
    assert {"unknown": "no such file", "batch purpose": "not a 'dataset' one",
            "items too": "give no prompts"}[case] in e["msg"]


def test_custom_ids_seen_past_memory_go_to_disk(monkeypatch):
    from api import unique
    monkeypatch.setattr(unique, "MEMORY", 3)
    with unique.Seen() as seen:
        assert all(seen.add(f"id{i}") for i in range(10))
        assert seen.db is not None and len(seen.ids) == 3
        assert not seen.add("id1") and not seen.add("id7")  # one in memory, one on disk
        assert seen.add("id10")
        where = seen.dir.name
    assert seen.db is None and not os.path.exists(where)


def test_a_validation_whose_api_process_is_killed_is_finished_by_another(tmp_path, storage_dir):
    """kill -9 of the API process reading a dataset, once it saved a checkpoint: the other
    API process of its Redis resumes the validation from there once the lease has expired
    (FANOUT_VALIDATION_LEASE, then its next sweep), and the job is laid out once, whole,
    with its id and seed."""
    import signal

    import redis as redis_lib

    from api import sweep
    from conftest import start_api
    from cli.redis_server import EmbeddedRedis

    server = EmbeddedRedis()
    lease = 5  # seconds (30 by default)
    env = {"FANOUT_INPUT_ROOT": str(tmp_path), "FANOUT_VALIDATION_LEASE": str(lease),
           "FANOUT_MODELS": "llama"}  # no worker here: the fleet's model named
    with open(tmp_path / "rows.jsonl", "w") as f:
        for i in range(60_000):  # a seed per line: each one checked whole (api/dataset.py FAST), slower
            f.write(json.dumps({"prompt": f"row {i}", "custom_id": f"k{i}", "sampling_params": {"seed": i}}) + "\n")
    dying, url = start_api(server.url, tmp_path, "api-dying", env=env)
    other, other_url = start_api(server.url, tmp_path, "api-other", env=env)
    r = redis_lib.Redis.from_url(server.url)
    try:
        job = httpx.post(url + "/v1/jobs", json={"input_url": f"file://{tmp_path}/rows.jsonl", "seed": 9,
                                                 "run_at": "2099-01-01T00:00:00Z"}).json()
        assert job["status"] == "validating"
        wait_for(lambda: os.path.isdir(storage_dir / "jobs" / job["id"] / "items"), 30, "its first shards laid out")
        wait_for(lambda: r.exists(keys.checkpoint(job["id"])), 30, "its first checkpoint")
        dying.stop(signal.SIGKILL)
        assert httpx.get(f"{other_url}/v1/jobs/{job['id']}").json()["status"] == "validating"
        t0 = time.monotonic()
        info = wait_for(lambda: (j := httpx.get(f"{other_url}/v1/jobs/{job['id']}").json())["status"] != "validating"
                        and j, lease + 2 * sweep.SWEEP + 90, "another API process to finish it")
        took = time.monotonic() - t0
        assert info["status"] == "scheduled" and info["progress"]["total"] == 60_000 and info["seed"] == 9, info
        with open(other.log_path, errors="replace") as log:
            text = log.read()
        assert "stopped midway (its API process went away); starting it again" in text
        resumed = re.search(r"resuming its validation at row (\d+) \((\d+) items laid out before\)", text)
        assert resumed and int(resumed[1]) > 1 and int(resumed[2]) == int(resumed[1]) - 1, text[-2000:]
        assert took >= lease - 1  # not before the dead one's lease ran out
        print(f"\nvalidation resumed at row {resumed[1]} of 60,000; queued {took:.1f} s after the kill")
        page = httpx.get(f"{other_url}/v1/jobs/{job['id']}/results", params={"offset": 59_990, "limit": 10}).json()
        assert [it["custom_id"] for it in page["items"]] == [f"k{i}" for i in range(59_990, 60_000)]
        assert not r.sismember(keys.validating(), job["id"])
    finally:
        for p in (dying, other):
            p.stop()
        r.close()
        server.stop()


def test_a_dataset_of_openai_batch_lines_runs_their_items(api_url, worker, engine):
    """The lines of an OpenAI batch file as a native dataset: each the chat its body asks,
    with its max_tokens and temperature, answered as the model answers it; a line this
    server would not run is named with its body's field."""
    from test_openai_batch import chat_ids, chat_line

    from worker.engine import SamplingParams
    texts = ["hi", "why is the sky blue?", "write a poem"]
    lines = [chat_line(f"o{i}", t, max_tokens=4, temperature=0) for i, t in enumerate(texts)]
    job = validated(api_url, httpx.post(api_url + "/v1/jobs", json={"input_file_id": upload(api_url, lines)}))
    got = finished(api_url, job["id"])
    ref = engine.generate(input_ids=[chat_ids(engine, t) for t in texts],
                          sampling_params=SamplingParams(max_new_tokens=4, temperature=0))
    assert [(it["custom_id"], it["samples"][0]["token_ids"]) for it in got] == \
        [(f"o{i}", x.samples[0].token_ids) for i, x in enumerate(ref)]
    bad = lines[:1] + [chat_line("s", "x", stream=True), {**chat_line("u", "x"), "url": "/v1/embeddings"}]
    job = validated(api_url, httpx.post(api_url + "/v1/jobs", json={"input_file_id": upload(api_url, bad)}))
    assert job["status"] == "failed", job
    assert [e["loc"] for e in job["errors"]] == [["body", "input_file_id", 2, "body", "stream"],
                                                 ["body", "input_file_id", 3, "url"]], job["errors"]


def test_a_resumed_validation_lays_out_the_same_and_knows_the_ids_before_its_checkpoint(tmp_path):
    """plan() over a dataset, its reader dying after 23 rows, then resumed from its last
    checkpoint by a new builder: the same shards and layout as one reading of it, and a
    custom id repeated after the checkpoint of one before it is still named."""
    import redis as redis_lib
    from fastapi.exceptions import RequestValidationError

    from api.dataset import plan
    from api.schemas import JobRequest
    from cli.redis_server import EmbeddedRedis
    from jobs import items
    from jobs.settings import Settings
    from results import blobs

    server = EmbeddedRedis()
    r = redis_lib.Redis.from_url(server.url)
    store = blobs.open_store(str(tmp_path))
    settings, req = Settings(shard_samples=3), JobRequest(input_url="file:///rows.jsonl")
    rows = [(i + 1, json.dumps({"prompt": f"p{i}", "custom_id": f"c{i}",
                                "sampling_params": {"n": 1 + i % 3}}).encode()) for i in range(40)]

    def builder(job: str) -> items.Builder:
        return items.Builder(r, store, job, settings.shard_samples, state_every=0)  # a state at every shard

    def dying(records, after: int):
        for rec in records:
            if rec[0] > after:
                raise ConnectionResetError("the reader's process died")
            yield rec

    try:
        whole = plan(iter(rows), req, settings, builder("whole"), 7)
        for job, tail in (("resumed", []), ("repeated", [(41, json.dumps({"prompt": "x", "custom_id": "c2"}).encode())])):
            saved = []
            with pytest.raises(ConnectionResetError):
                plan(dying(iter(rows + tail), 23), req, settings, builder(job), 7, saved.append)
            assert saved and saved[-1]["row"] <= 23 and saved[-1]["count"] == saved[-1]["row"] - 1
            if not tail:
                got = plan(iter(rows), req, settings, builder(job), 7, saved.append, saved[-1])
                assert (got.kind, list(got.ns), got.tokens) == (whole.kind, list(whole.ns), whole.tokens)
                assert got.lay.bounds == whole.lay.bounds
                for k in range(got.lay.total):
                    assert b"".join(store.get(keys.items_blob(job, k))) == \
                        b"".join(store.get(keys.items_blob("whole", k)))
            else:
                with pytest.raises(RequestValidationError) as e:
                    plan(iter(rows + tail), req, settings, builder(job), 7, None, saved[-1])
                assert "custom_id 'c2' is used by an earlier line" in str(e.value.errors())
    finally:
        r.close()
        server.stop()
