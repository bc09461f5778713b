"""Files in an S3-compatible bucket (moto's server, its own process) through the official
`openai` client: the bytes are in the bucket, never in Redis; a store that is down fails
what needs it with a clear error, and a batch that ended meanwhile is finalized, with every
line, once the store is back."""
import json
import os
import time
import uuid

import openai
import pytest

from conftest import WorkerProc, start_api, wait_for
from worker.redis_server import EmbeddedRedis, free_port
from results import keys
from test_openai_batch import chat_line, jsonl, read_lines, wait


@pytest.fixture(scope="module")
def s3_service(s3_server, model_dir, tmp_path_factory):
    """Its own Redis, worker and API, the API's files in a bucket: the API processes of one
    Redis share one store (each finalizes any batch), so the suite's own are kept apart."""
    logs = tmp_path_factory.mktemp("s3-service")
    server = EmbeddedRedis()
    worker = WorkerProc(server.url, model_dir, logs)
    worker.start()
    bucket = "fanout-" + uuid.uuid4().hex[:8]
    s3_server.client().create_bucket(Bucket=bucket)
    env = {**s3_server.env, "FANOUT_STORAGE_URL": f"s3://{bucket}/tenant-a"}
    proc, url = start_api(server.url, logs, "api-s3", env=env)
    yield {"url": url, "bucket": bucket, "proc": proc, "redis_url": server.url, "env": env, "logs": logs}
    proc.stop()
    worker.stop()
    server.stop()


@pytest.fixture
def s3_api(s3_service):
    with openai.OpenAI(base_url=s3_service["url"] + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c, s3_service["bucket"], s3_service["proc"]


def objects(s3_server, bucket) -> dict[str, int]:
    listed = s3_server.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: o["Size"] for o in listed}


def test_files_live_in_the_bucket_not_in_redis(s3_api, s3_server, s3_service):
    import redis as redis_lib
    redis = redis_lib.Redis.from_url(s3_service["redis_url"])
    oai, bucket, _ = s3_api
    lines = [chat_line(f"q{i}", f"question {i}", max_tokens=4, temperature=0) for i in range(5)]
    data = jsonl(lines)
    f = oai.files.create(file=("in.jsonl", data), purpose="batch")
    assert objects(s3_server, bucket) == {f"tenant-a/files/{f.id}.jsonl": len(data)}
    assert oai.files.content(f.id).content == data
    # Redis holds the file's object only: a few hundred bytes, not the file.
    assert len(redis.get(keys.file(f.id))) < 400 and not redis.keys(f"*{f.id}*content*")
    b = wait(oai, oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                     completion_window="24h").id, ("completed",))
    out = read_lines(oai, b.output_file_id)
    assert [x["custom_id"] for x in out] == [x["custom_id"] for x in lines]
    assert f"tenant-a/files/{b.output_file_id}.jsonl" in objects(s3_server, bucket)
    oai.files.delete(f.id)
    assert f"tenant-a/files/{f.id}.jsonl" not in objects(s3_server, bucket)
    with pytest.raises(openai.NotFoundError):
        oai.files.content(f.id)
    redis.close()


def test_an_api_with_another_store_than_its_redis_has_does_not_start(s3_service):
    """Files written to one store and served from another would be lost: refused at start."""
    import subprocess
    import sys
    env = {**os.environ, **s3_service["env"], "FANOUT_STORAGE_URL": "file:///tmp/elsewhere"}
    p = subprocess.run([sys.executable, "-m", "worker.cli", "api", "--port", str(free_port()), "--redis-url",
                        s3_service["redis_url"]], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert (f"FANOUT_STORAGE_URL is file:///tmp/elsewhere but this Redis's files are in "
            f"s3://{s3_service['bucket']}/tenant-a") in p.stderr, p.stderr


def test_a_store_that_is_down_fails_clearly_and_loses_nothing_once_back(s3_api, s3_server):
    oai, bucket, proc = s3_api
    lines = [chat_line(f"q{i}", f"question {i}", max_tokens=16, temperature=0) for i in range(6)]
    f = oai.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    s3_server.stop()
    try:
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError, match="blob store unavailable") as e:
            oai.files.content(f.id)
        assert e.value.status_code == 503 and e.value.code == "store_unavailable"
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
    s3_server.client().create_bucket(Bucket=bucket)  # moto's buckets lived in its memory: an empty store back

    f = oai.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    b = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    s3_server.stop()  # the batch's input is read: it runs, and ends with nowhere to write its files
    try:
        wait_for(lambda: "cannot be finalized yet" in proc.tail(), 120, "a finalization that failed")
        assert oai.batches.retrieve(b.id).status == "finalizing"
        assert "blob store" in proc.tail() and "unreachable" in proc.tail()
    finally:
        s3_server.start()
    s3_server.client().create_bucket(Bucket=bucket)
    b = wait(oai, b.id, ("completed",), timeout=30)  # the next sweeps, a second apart
    out = read_lines(oai, b.output_file_id)
    assert [x["custom_id"] for x in out] == [x["custom_id"] for x in lines]
    assert all(x["response"]["status_code"] == 200 for x in out) and b.request_counts.completed == len(lines)
    assert json.loads(oai.files.content(b.output_file_id).text.splitlines()[0])["custom_id"] == "q0"


def test_the_sweep_deletes_the_bytes_of_expired_deleted_and_orphaned_files(tmp_path):
    import redis as redis_lib

    from api.openai import files
    from results import blobs

    server = EmbeddedRedis()  # a Redis of its own: the sweep looks at every due file
    r = redis_lib.Redis.from_url(server.url)
    store = blobs.open_store(str(tmp_path))

    def there(file_id):
        return (tmp_path / files.blob(file_id)).exists()

    short = files.save(r, store, [b"a\n"], "a.jsonl", "batch", None, ttl=1)
    kept = files.save(r, store, [b"b\n"], "b.jsonl", "batch", None, ttl=None)
    later = files.save(r, store, [b"c\n"], "c.jsonl", "batch", None, ttl=3600)
    files.writing(r, "file-orphan")  # a writer that died before its file's object
    with store.writer(files.blob("file-orphan")) as w:
        w.write(b"d\n")
    assert r.zscore(keys.files_due(), kept["id"]) is None
    wait_for(lambda: not r.exists(keys.file(short["id"])), 5, "the short file's object to expire")
    assert files.sweep_once(r, store) == 1
    assert not there(short["id"]) and there(kept["id"]) and there(later["id"]) and there("file-orphan")
    # An hour on: the orphan goes; the file whose object is still there (an hour from
    # its expiry, but alive) gets its object's expiry again instead.
    r.zadd(keys.files_due(), {later["id"]: 0})
    assert files.sweep_once(r, store, now=time.time() + files.ORPHAN + 1) == 1
    assert not there("file-orphan") and there(later["id"])
    assert r.zscore(keys.files_due(), later["id"]) > time.time() + 3000
    r.close()
    server.stop()
