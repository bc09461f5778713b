"""Files in an S3-compatible bucket (moto's server, its own process) through the official
`openai` client: the bytes are in the bucket, never in Redis; a store that is down fails
what needs it with a clear error, and a batch that ended meanwhile is finalized, with every
line, once the store is back."""
import json
import os
import time
import uuid
from datetime import datetime

import httpx
import openai
import pytest

from conftest import WorkerProc, follow_stream, start_api, wait_for
from cli.redis_server import EmbeddedRedis, free_port
from results import keys
from test_openai_batch import chat_line, jsonl, read_lines, wait


HOLD = 2


@pytest.fixture(scope="module")
def s3_service(s3_server, model_dir, tmp_path_factory):
    """Its own Redis, worker and API, the API's files in a bucket: the API processes of one
    Redis share one store (each finalizes any batch), so the suite's own are kept apart."""
    logs = tmp_path_factory.mktemp("s3-service")
    server = EmbeddedRedis()
    bucket = "fanout-" + uuid.uuid4().hex[:8]
    s3_server.client().create_bucket(Bucket=bucket)
    # Every job's items in the bucket too: its worker reads them from there.
    # A held shard is queued again HOLD s on (10 by default).
    env = {**s3_server.env, "FANOUT_STORAGE_URL": f"s3://{bucket}/tenant-a", "FANOUT_ITEMS_STORE_BYTES": "0",
           "FANOUT_SHARD_HOLD": str(HOLD)}
    worker = WorkerProc(server.url, model_dir, logs, env=env)
    worker.start()
    proc, url = start_api(server.url, logs, "api-s3", env=env)
    yield {"url": url, "bucket": bucket, "proc": proc, "redis_url": server.url, "env": env, "logs": logs}
    proc.stop()
    worker.stop()
    server.stop()


@pytest.fixture
def s3_api(s3_service):
    import redis as redis_lib
    with openai.OpenAI(base_url=s3_service["url"] + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        r = redis_lib.Redis.from_url(s3_service["redis_url"])
        yield c, s3_service["bucket"], s3_service["proc"], r
        r.close()


def objects(s3_server, bucket) -> dict[str, int]:
    listed = s3_server.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: o["Size"] for o in listed}


def test_files_live_in_the_bucket_not_in_redis(s3_api, s3_server, s3_service):
    oai, bucket, _, redis = s3_api
    lines = [chat_line(f"q{i}", f"question {i}", max_tokens=4, temperature=0) for i in range(5)]
    data = jsonl(lines)
    f = oai.files.create(file=("in.jsonl", data), purpose="batch")
    assert {k: v for k, v in objects(s3_server, bucket).items() if "/files/" in k} == {
        f"tenant-a/files/{f.id}.jsonl": len(data)}
    assert oai.files.content(f.id).content == data
    # Redis holds the file's object only: a few hundred bytes, not the file.
    assert len(redis.get(keys.file(f.id))) < 400 and not redis.keys(f"*{f.id}*content*")
    b = wait(oai, oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                     completion_window="24h").id, ("completed",))
    out = read_lines(oai, b.output_file_id)
    assert [x["custom_id"] for x in out] == [x["custom_id"] for x in lines]
    stored = objects(s3_server, bucket)
    assert f"tenant-a/files/{b.output_file_id}.jsonl" in stored
    job_id = b.id.removeprefix("batch_")  # its items were read from the bucket, not Redis
    assert f"tenant-a/jobs/{job_id}/items/0.json" in stored and not redis.exists(keys.items(job_id))
    oai.files.delete(f.id)
    assert f"tenant-a/files/{f.id}.jsonl" not in objects(s3_server, bucket)
    with pytest.raises(openai.NotFoundError):
        oai.files.content(f.id)


def test_an_api_with_another_store_than_its_redis_has_does_not_start(s3_service):
    """Files written to one store and served from another would be lost: refused at start."""
    import subprocess
    import sys
    env = {**os.environ, **s3_service["env"], "FANOUT_STORAGE_URL": "file:///tmp/elsewhere"}
    p = subprocess.run([sys.executable, "-m", "cli.main", "api", "--port", str(free_port()), "--redis-url",
                        s3_service["redis_url"]], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert (f"FANOUT_STORAGE_URL is file:///tmp/elsewhere but this Redis's files are in "
            f"s3://{s3_service['bucket']}/tenant-a") in p.stderr, p.stderr


def test_a_store_that_is_down_fails_clearly_and_loses_nothing_once_back(s3_api, s3_server):
    oai, bucket, proc, redis = s3_api
    lines = [chat_line(f"q{i}", f"question {i}", max_tokens=16, temperature=0) for i in range(6)]
    f = oai.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    s3_server.stop()
    try:
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError, match="blob store unavailable") as e:
            oai.files.content(f.id)
        assert e.value.status_code == 503 and e.value.code == "store_unavailable"
        assert e.value.response.headers["Retry-After"] == "5"  # every 503 says when to try again
        with pytest.raises(openai.InternalServerError, match="blob store unavailable"):
            oai.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        with pytest.raises(openai.InternalServerError, match="blob store unavailable"):
            oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert time.monotonic() - t0 < 3 * 3 * (5 + 30)  # three calls; the client's timeouts, three tries each
        [failed] = [b for b in oai.batches.list() if b.input_file_id == f.id]
        assert failed.status == "failed" and failed.errors.data[0].code == "store_unavailable"
        assert "create the batch again" in failed.errors.data[0].message
    finally:
        s3_server.start()

    lines = [chat_line(f"q{i}", f"question {i}", max_tokens=300, temperature=0, ignore_eos=True) for i in range(6)]
    f = oai.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    b = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    # Its one shard's items read by the worker (a sample is streaming), it runs on, and ends
    # with nowhere to write its files.
    job_stream = keys.stream(b.id.removeprefix("batch_"))
    follow_stream(redis, b.id.removeprefix("batch_"))
    wait_for(lambda: any(e[b"type"] == b"delta" for _, e in redis.xrange(job_stream)), 60,
             "a first delta")
    s3_server.stop()
    try:
        wait_for(lambda: "cannot be finalized yet" in proc.tail(), 120, "a finalization that failed")
        waiting = oai.batches.retrieve(b.id)  # and the batch says why, not only the API's log
        assert waiting.status == "finalizing" and waiting.errors.data[0].code == "store_unavailable", waiting
        assert "wait for the blob store" in waiting.errors.data[0].message
        assert "blob store" in proc.tail() and "unreachable" in proc.tail()
    finally:
        s3_server.start()
    b = wait(oai, b.id, ("completed",), timeout=30)  # the next sweeps, a second apart
    assert b.errors is None  # no longer waiting
    out = read_lines(oai, b.output_file_id)
    assert [x["custom_id"] for x in out] == [x["custom_id"] for x in lines]
    assert all(x["response"]["status_code"] == 200 for x in out) and b.request_counts.completed == len(lines)
    assert json.loads(oai.files.content(b.output_file_id).text.splitlines()[0])["custom_id"] == "q0"


def test_a_dataset_named_by_its_s3_url_in_the_store(s3_service, s3_server):
    url, bucket = s3_service["url"], s3_service["bucket"]
    rows = "".join(json.dumps({"prompt": f"s3 row {i}", "custom_id": f"s{i}"}) + "\n" for i in range(30))
    s3_server.client().put_object(Bucket=bucket, Key="tenant-a/data/rows.jsonl", Body=rows.encode())
    r = httpx.post(url + "/v1/jobs", json={"input_url": f"s3://{bucket}/tenant-a/data/rows.jsonl",
                                           "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    wait_for(lambda: httpx.get(f"{url}/v1/jobs/{job_id}").json()["status"] == "succeeded", 120, "the job")
    got = [json.loads(x) for x in httpx.get(f"{url}/v1/jobs/{job_id}/output").text.splitlines()]
    assert [(it["custom_id"], len(it["samples"])) for it in got] == [(f"s{i}", 1) for i in range(30)]
    # Only the configured store: another bucket, or outside its prefix, is refused.
    for other in ("s3://other-bucket/tenant-a/data/rows.jsonl", f"s3://{bucket}/tenant-b/rows.jsonl"):
        r = httpx.post(url + "/v1/jobs", json={"input_url": other})
        assert r.status_code == 422 and "not in the configured blob store" in r.text, r.text
    r = httpx.post(url + "/v1/jobs", json={"input_url": f"s3://{bucket}/tenant-a/data/none.jsonl"})
    assert r.status_code == 422 and "no such object" in r.text, r.text


def test_the_sweep_deletes_the_bytes_of_expired_deleted_and_orphaned_files(tmp_path):
    import redis as redis_lib

    from api import sweep
    from api.openai import files
    from results import blobs

    server = EmbeddedRedis()  # a Redis of its own: the sweep looks at every due file
    r = redis_lib.Redis.from_url(server.url)
    store = blobs.open_store(str(tmp_path))

    def there(file_id):
        return (tmp_path / keys.file_blob(file_id)).exists()

    short = files.save(r, store, [b"a\n"], "a.jsonl", "batch", None, ttl=1)
    kept = files.save(r, store, [b"b\n"], "b.jsonl", "batch", None, ttl=None)
    later = files.save(r, store, [b"c\n"], "c.jsonl", "batch", None, ttl=3600)
    files.writing(r, "file-orphan")  # a writer that died before its file's object
    with store.writer(keys.file_blob("file-orphan")) as w:
        w.write(b"d\n")
    assert r.zscore(keys.blobs_due(), keys.due_file(kept["id"])) is None
    wait_for(lambda: not r.exists(keys.file(short["id"])), 5, "the short file's object to expire")
    assert sweep.sweep_once(r, store) == 1
    assert not there(short["id"]) and there(kept["id"]) and there(later["id"]) and there("file-orphan")
    # An hour on: the orphan goes; the file whose object is still there (an hour from
    # its expiry, but alive) gets its object's expiry again instead.
    r.zadd(keys.blobs_due(), {keys.due_file(later["id"]): 0})
    assert sweep.sweep_once(r, store, now=time.time() + blobs.ORPHAN + 1) == 1
    assert not there("file-orphan") and there(later["id"])
    assert r.zscore(keys.blobs_due(), keys.due_file(later["id"])) > time.time() + 3000
    # A job's items and results: deleted once its keys are gone (it expired, or its submit
    # failed), not before.
    for job_id in ("gone", "alive"):
        r.zadd(keys.blobs_due(), {keys.due_job(job_id, 0, 2): 0})
        for k in range(2):
            for blob in (keys.items_blob(job_id, k), keys.results_blob(job_id, k)):
                with store.writer(blob) as w:
                    w.write(b"[]")
    r.hset(keys.info("alive"), "total", 1)
    r.expire(keys.info("alive"), 600)
    assert sweep.sweep_once(r, store) == 1
    assert not (tmp_path / "jobs" / "gone" / "items" / "0.json").exists()
    assert not (tmp_path / "jobs" / "gone" / "results" / "1.jsonl").exists()
    assert (tmp_path / "jobs" / "alive" / "items" / "1.json").exists()
    assert (tmp_path / "jobs" / "alive" / "results" / "1.jsonl").exists()
    assert r.zscore(keys.blobs_due(), keys.due_job("alive", 0, 2)) > time.time() + 500
    r.close()
    server.stop()


def test_a_job_whose_items_cannot_be_read_waits_for_the_store_and_runs_once_it_is_back(s3_service, s3_server):
    import datetime

    url, bucket = s3_service["url"], s3_service["bucket"]
    run_at = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=3)).isoformat()
    job = httpx.post(url + "/v1/jobs", json={"prompts": ["a", "b"], "sampling_params": {"max_new_tokens": 2},
                                             "run_at": run_at}).json()
    s3_server.stop()  # before its worker reads the items
    try:
        # The store refuses connections: each attempt is held (no strike), the job queued
        # with the store's error, for as long as it stays away (past the job's retries).
        def held(n):  # between attempts (each is `running` while its worker tries the store)
            j = httpx.get(f"{url}/v1/jobs/{job['id']}").json()
            return j["attempt"] >= n and j["status"] == "queued" and j
        info = wait_for(lambda: held(4), 5 * (HOLD + 3 * (5 + 30)), "four held attempts", interval=0.2)
        assert f"blob store s3://{bucket}/tenant-a: cannot read jobs/{job['id']}/items/0.json: unreachable" \
            in info["error"], info
        assert f"tried again every {HOLD} s" in info["error"]
    finally:
        s3_server.start()
    # Back: the next attempt reads the items, and the job runs to its end.
    info = wait_for(lambda: (j := httpx.get(f"{url}/v1/jobs/{job['id']}").json())["status"] in ("succeeded", "failed")
                    and j, HOLD + 60, "the job to end")
    assert info["status"] == "succeeded" and info["error"] is None and info["progress"]["done"] == 2, info


def test_a_job_with_its_items_in_the_store_survives_a_killed_worker(model_dir, engine, tmp_path):
    """Items in a local store (the default), shards of 2 samples over two workers; one is
    killed mid-job: the shards it held are read again from the store by the other, and
    every item is answered once, as the engine answers it."""
    import redis as redis_lib
    import signal

    from results import reader
    from worker.engine import SamplingParams

    server = EmbeddedRedis()
    env = {"FANOUT_STORAGE_URL": f"file://{tmp_path}/store", "FANOUT_ITEMS_STORE_BYTES": "0",
           "FANOUT_SHARD_SAMPLES": "2", "FANOUT_HEARTBEAT_TTL": "3"}
    dead, live = WorkerProc(server.url, model_dir, tmp_path, env), WorkerProc(server.url, model_dir, tmp_path, env)
    api, url = start_api(server.url, tmp_path, "api-items", env=env)
    r = redis_lib.Redis.from_url(server.url)
    try:
        dead.start()
        live.start()
        prompts = [f"item {i} of the stored job" for i in range(12)]
        job = httpx.post(url + "/v1/jobs", json={"prompts": prompts, "sampling_params": {
            "max_new_tokens": 60, "temperature": 0, "ignore_eos": True}}).json()
        assert sorted(os.listdir(tmp_path / "store" / "jobs" / job["id"] / "items")) == sorted(
            f"{k}.json" for k in range(6))
        assert not r.exists(keys.items(job["id"]))
        wait_for(lambda: httpx.get(f"{url}/v1/jobs/{job['id']}").json()["progress"]["done"] >= 2, 60,
                 "two items finished")
        dead.stop(signal.SIGKILL)
        wait_for(lambda: httpx.get(f"{url}/v1/jobs/{job['id']}").json()["status"] == "succeeded", 120,
                 "the job to succeed")
        # Each sample stored once (a second store would count twice); its finished shards'
        # stream entries are trimmed, so a follower from the start is told so.
        assert r.hmget(keys.info(job["id"]), "samples_done", "done") == [b"12", b"12"]
        seen = [e["type"] for _, e in reader.follow(r, job["id"], timeout=5)]
        assert seen[0] == "trimmed" and seen[-1] == "status", seen
        got = httpx.get(f"{url}/v1/jobs/{job['id']}/results").json()["items"]
        ref = engine.generate(prompts=prompts, sampling_params=SamplingParams(max_new_tokens=60, temperature=0,
                                                                               ignore_eos=True))
        assert [it["samples"][0]["token_ids"] for it in got] == [x.samples[0].token_ids for x in ref]
    finally:
        for w in (dead, live):
            if w.proc and w.proc.alive():
                w.stop(signal.SIGKILL)
        api.stop()
        r.close()
        server.stop()


def test_the_builder_cuts_as_plan_does_and_what_an_abandoned_one_wrote_is_swept(tmp_path):
    import redis as redis_lib

    from api import sweep
    from results import blobs
    from jobs import items
    from jobs.spec import plan

    server = EmbeddedRedis()
    r = redis_lib.Redis.from_url(server.url)
    store = blobs.open_store(str(tmp_path))
    ns = [1, 3, 2, 1, 1, 5, 1, 2]
    b = items.Builder(r, store, "whole", 3)
    for i, n in enumerate(ns):
        b.add(json.dumps({"x": f"p{i}"}), n)
    lay = b.finish()
    assert lay.bounds == plan(ns, 3) and lay.chunks is None
    for k in range(lay.total):
        got = json.loads(b"".join(store.get(keys.items_blob("whole", k))))
        assert got == [{"x": f"p{i}"} for i in range(lay.bounds[k], lay.bounds[k + 1])]
    # Given up after four items (an invalid line): what it wrote is due at once.
    b = items.Builder(r, store, "halfway", 3)
    for i, n in enumerate(ns[:4]):
        b.add(json.dumps({"x": i}), n)
    b.abandon()
    written = os.listdir(tmp_path / "jobs" / "halfway" / "items")
    assert written  # the full shards were written before it gave up
    sweep.sweep_once(r, store)
    assert os.listdir(tmp_path / "jobs" / "halfway" / "items") == []
    # The whole one's shards were marked due an hour on (ORPHAN): no job was created for it either.
    assert sweep.sweep_once(r, store, now=time.time() + blobs.ORPHAN + 1) >= 1
    assert os.listdir(tmp_path / "jobs" / "whole" / "items") == []
    r.close()
    server.stop()


def test_a_tenant_reads_by_url_only_its_own_datasets_never_the_services_objects(s3_server, tmp_path):
    """Tenant B names tenant A's upload (the store's own layout: PREFIX/files/<id>.jsonl), A's
    job items, A's dataset and A's folder under FANOUT_INPUT_ROOT: each a 422 naming
    input_url, and no job. A reads its own prefix (datasets/<its id>/, and its folder on
    disk). Before: B's job of A's upload succeeded and B read A's rows from /results."""
    import redis as redis_lib

    from api import tenants

    server = EmbeddedRedis()
    bucket = "fanout-" + uuid.uuid4().hex[:8]
    s3 = s3_server.client()
    s3.create_bucket(Bucket=bucket)
    inputs = tmp_path / "inputs"
    env = {**s3_server.env, "FANOUT_STORAGE_URL": f"s3://{bucket}/svc", "FANOUT_ITEMS_STORE_BYTES": "0",
           "FANOUT_INPUT_ROOT": str(inputs), "FANOUT_MODELS": "llama"}  # no worker: the fleet's model named
    proc, url = start_api(server.url, tmp_path, "api-tenant-urls", env=env)
    r = redis_lib.Redis.from_url(server.url)
    try:
        key_a, a = tenants.create(r, "a", {})
        key_b, b = tenants.create(r, "b", {})
        rows = "".join(json.dumps({"prompt": f"secret of a {i}"}) + "\n" for i in range(3)).encode()
        s3.put_object(Bucket=bucket, Key=f"svc/datasets/{a.id}/rows.jsonl", Body=rows)
        (inputs / a.id).mkdir(parents=True)
        (inputs / a.id / "rows.jsonl").write_bytes(rows)
        as_a = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key_a}"}, timeout=30)
        as_b = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key_b}"}, timeout=30)
        upload = as_a.post("/v1/files", files={"file": ("rows.jsonl", rows)}, data={"purpose": "dataset"})
        assert upload.status_code == 200, upload.text
        own = as_a.post("/v1/jobs", json={"input_url": f"s3://{bucket}/svc/datasets/{a.id}/rows.jsonl"})
        assert own.status_code == 202, own.text
        job_a = own.json()["id"]
        wait_for(lambda: as_a.get(f"/v1/jobs/{job_a}").json()["status"] == "queued", 60, "A's dataset validated")
        assert objects(s3_server, bucket).get(f"svc/jobs/{job_a}/items/0.json")
        on_disk = as_a.post("/v1/jobs", json={"input_url": f"file://{inputs}/{a.id}/rows.jsonl"})
        assert on_disk.status_code == 202, on_disk.text

        for other in (f"s3://{bucket}/svc/files/{upload.json()['id']}.jsonl",  # A's upload
                      f"s3://{bucket}/svc/jobs/{job_a}/items/0.json",  # A's job's items
                      f"s3://{bucket}/svc/datasets/{a.id}/rows.jsonl",  # A's dataset
                      f"s3://{bucket}/svc/datasets/{b.id}/../{a.id}/rows.jsonl",
                      f"file://{inputs}/{a.id}/rows.jsonl"):  # A's folder on disk
            got = as_b.post("/v1/jobs", json={"input_url": other})
            assert got.status_code == 422, (other, got.text)
            assert got.json()["detail"][0]["loc"] == ["body", "input_url"], got.text
        assert as_b.get("/v1/jobs").json()["data"] == []  # no job made
        # A itself never reads the service's objects by URL either: its file goes by input_file_id.
        mine = as_a.post("/v1/jobs", json={"input_url": f"s3://{bucket}/svc/files/{upload.json()['id']}.jsonl"})
        assert mine.status_code == 422 and "input_file_id" in mine.text, mine.text
        as_a.close()
        as_b.close()
    finally:
        r.close()
        proc.stop()
        server.stop()


def test_a_batch_whose_results_the_store_lost_fails_naming_them(s3_server, model_dir, tmp_path):
    """The bucket loses a job's objects mid-job (the first shard's kept results, the items of
    the shards still to run): the job fails naming the items, and the batch fails within
    seconds of it with `results_lost` naming the shard's results. Before: it stayed
    `finalizing`, `errors: null`, for as long as anyone watched (the cause in the API's log)."""
    server = EmbeddedRedis()
    bucket = "fanout-" + uuid.uuid4().hex[:8]
    s3 = s3_server.client()
    s3.create_bucket(Bucket=bucket)
    # One sample a shard, one shard at a time: shard 0 is kept in the bucket before shard 2 starts.
    env = {**s3_server.env, "FANOUT_STORAGE_URL": f"s3://{bucket}/svc", "FANOUT_ITEMS_STORE_BYTES": "0",
           "FANOUT_SHARD_SAMPLES": "1"}
    worker = WorkerProc(server.url, model_dir, tmp_path, env=env, args=["--max-running", "1"])
    proc, url = start_api(server.url, tmp_path, "api-lost", env=env)
    try:
        worker.start()
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as oai:
            lines = [chat_line(f"q{i}", f"question {i}", max_tokens=100, temperature=0, ignore_eos=True)
                     for i in range(6)]
            f = oai.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
            b = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            job = b.id.removeprefix("batch_")
            kept = f"svc/jobs/{job}/results/0.jsonl"
            wait_for(lambda: kept in objects(s3_server, bucket), 120, "shard 0's results kept in the bucket")
            for key in [k for k in objects(s3_server, bucket) if k.startswith(f"svc/jobs/{job}/")]:
                s3.delete_object(Bucket=bucket, Key=key)  # the store lost them
            b = wait(oai, b.id, ("failed", "completed"), timeout=120)
            assert b.status == "failed" and b.errors.data[0].code == "results_lost", b
            assert "shard 0's results are gone from the blob store" in b.errors.data[0].message, b.errors
            assert f"jobs/{job}/results/0.jsonl" in b.errors.data[0].message
            info = httpx.get(f"{url}/v1/jobs/{job}", timeout=30).json()
            assert info["status"] == "failed" and "are gone" in info["error"], info
            ended = datetime.fromisoformat(info["ended_at"].replace("Z", "+00:00")).timestamp()
            # The sweep looks once a second: the batch fails at its first finalization.
            assert b.failed_at - ended < 5, (b.failed_at, info["ended_at"])
            print(f"\nlost objects: the batch failed {max(0, b.failed_at - int(ended))} s after its job "
                  "(failed_at is in whole seconds)")
    finally:
        proc.stop()
        worker.stop()
        server.stop()
