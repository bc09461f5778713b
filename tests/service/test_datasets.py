"""Native datasets: a job naming a file of items (POST /v1/files purpose `dataset`, then
POST /v1/jobs `input_file_id`) runs as the same items in a body would, past the body's item
cap, with its items in the blob store; bad lines are named."""
import json
import os

import httpx
import pytest

from conftest import wait_for
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
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["items"] == 100 and job["seed"] == 5
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
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
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
    got = httpx.get(f"{api_url}/v1/jobs/{job_id}/output", params={"format": "parquet"})
    assert got.status_code == 200 and got.headers["content-type"] == "application/vnd.apache.parquet"
    out = pq.read_table(pa.BufferReader(got.content)).to_pylist()
    assert [(row["index"], row["custom_id"]) for row in out] == [(i, f"p{i}") for i in range(40)]
    assert out[13]["samples"][0]["finish_reason"] == "error"
    ref = engine.generate(input_ids=[x for i, x in enumerate(ids) if i != 13],
                          sampling_params=SamplingParams(max_new_tokens=3, temperature=0))
    assert [row["samples"][0]["token_ids"] for i, row in enumerate(out) if i != 13] == \
        [x.samples[0].token_ids for x in ref]
    # The same as JSONL, one item per line as /results pages them.
    lines = httpx.get(f"{api_url}/v1/jobs/{job_id}/output").text.splitlines()
    assert [json.loads(x)["custom_id"] for x in lines] == [f"p{i}" for i in range(40)]
    # A bad row of a Parquet file is named as a line is.
    pq.write_table(pa.table({"prompt": ["fine", "", "fine too"]}), input_root / "bad.parquet")
    r = httpx.post(api_url + "/v1/jobs", json={"input_url": f"file://{input_root}/bad.parquet"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "input_url", 2, "prompt"], r.text


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


def test_bad_lines_are_named_and_no_job_is_made(api_url, worker):
    lines = [{"prompt": "fine"}, "!{not json", {"prompt": ""}, {"prompt": "x", "sampling_params": {"top_p": 7}},
             {"prompt": "x", "sampling_params": {"max_new_tokens": 5000}}, {"prompt": "x", "custom_id": "a"},
             {"prompt": "y", "custom_id": "a"}, {"input_ids": [1, 2]}, {"prompt": "x", "extra": 1}]
    file_id = upload(api_url, lines)
    before = httpx.get(api_url + "/v1/jobs", params={"limit": 1}).json()["data"]
    r = httpx.post(api_url + "/v1/jobs", json={"input_file_id": file_id})
    assert r.status_code == 422, r.text
    errors = {tuple(e["loc"][:3]): e for e in r.json()["detail"]}
    assert set(errors) == {("body", "input_file_id", n) for n in (2, 3, 4, 5, 7, 8, 9)}, r.json()
    assert errors[("body", "input_file_id", 3)]["loc"][3:] == ["prompt"]
    assert errors[("body", "input_file_id", 4)]["loc"][3:] == ["sampling_params", "top_p"]
    assert "FANOUT_MAX_NEW_TOKENS" in errors[("body", "input_file_id", 5)]["msg"]
    assert "used by an earlier line" in errors[("body", "input_file_id", 7)]["msg"]
    assert "same field as the first" in errors[("body", "input_file_id", 8)]["msg"]
    assert errors[("body", "input_file_id", 9)]["loc"][3:] == ["extra"]
    assert httpx.get(api_url + "/v1/jobs", params={"limit": 1}).json()["data"] == before


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
