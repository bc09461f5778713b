"""The blob store (results/blobs.py) on a local folder and on a real S3-compatible server
(moto's, as its own process): objects appear whole or not at all, stream in bounded
chunks, and a store that is down or refuses says so, naming itself."""
import os
import time
import uuid

import pytest

from results import blobs


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path, monkeypatch):
    if request.param == "local":
        return blobs.open_store(f"file://{tmp_path}/store")
    server = request.getfixturevalue("s3_server")
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    bucket = "b-" + uuid.uuid4().hex[:12]
    server.client().create_bucket(Bucket=bucket)
    return blobs.open_store(f"s3://{bucket}/some/prefix")


def read(store, key) -> bytes:
    return b"".join(store.get(key))


def test_round_trip_sizes_and_bounded_chunks(store):
    big = os.urandom(blobs.PART * 2 + 12345)  # three parts on S3
    for key, data in (("files/a.jsonl", b'{"x": 1}\n'), ("files/empty", b""), ("big/b.bin", big)):
        with store.writer(key) as w:
            for i in range(0, len(data), 100_000):
                w.write(data[i:i + 100_000])
        assert w.size == len(data)
        chunks = list(store.get(key))
        assert b"".join(chunks) == data
        assert all(len(c) <= blobs.CHUNK for c in chunks)
    with store.writer("files/a.jsonl") as w:  # again: replaces
        w.write(b"new\n")
    assert read(store, "files/a.jsonl") == b"new\n"


def test_whole_or_nothing(store):
    w = store.writer("files/partial")
    w.write(os.urandom(blobs.PART + 10))  # past one part: a multipart upload on S3
    with pytest.raises(blobs.Missing):
        store.get("files/partial")  # not there before commit
    w.abort()
    with pytest.raises(blobs.Missing):
        store.get("files/partial")
    with pytest.raises(RuntimeError):
        with store.writer("files/failed") as w:
            w.write(b"half")
            raise RuntimeError("the producer failed")
    with pytest.raises(blobs.Missing):
        store.get("files/failed")
    with store.writer("files/empty") as w:  # aborted within: leaving does not commit it
        w.abort()
    with pytest.raises(blobs.Missing):
        store.get("files/empty")
    if isinstance(store, blobs.S3Store):  # no parts left behind
        assert not store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads")
    else:
        assert sorted(os.listdir(store.root)) == ["files"] and os.listdir(os.path.join(store.root, "files")) == []


def test_delete_and_keys(store):
    with store.writer("x/y") as w:
        w.write(b"1")
    store.delete("x/y")
    store.delete("x/y")  # already gone: fine
    with pytest.raises(blobs.Missing):
        store.get("x/y")
    for bad in ("", "/abs", "a/../../etc"):
        with pytest.raises(ValueError):
            store.writer(bad)


def test_lines():
    assert list(blobs.lines([b"a\nb", b"c\n", b"\nd"])) == [b"a", b"bc", b"", b"d"]
    assert list(blobs.lines([b"a\n"])) == [b"a"]
    assert list(blobs.lines([])) == []


def test_urls(tmp_path):
    assert blobs.open_store(str(tmp_path)).root == str(tmp_path)
    assert blobs.open_store(f"file://{tmp_path}").url == f"file://{tmp_path}"
    for bad in ("s3://", "file://host/x", "ftp://x/y", ""):
        with pytest.raises(ValueError, match="FANOUT_STORAGE_URL"):
            blobs.open_store(bad)


def test_s3_that_refuses_or_is_down(s3_server, monkeypatch):
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    store = blobs.open_store("s3://no-such-bucket/p")
    with pytest.raises(blobs.StoreError, match="s3://no-such-bucket/p: cannot write files/f: bucket 'no-such-bucket' "
                                               "does not exist"):
        with store.writer("files/f") as w:
            w.write(b"x")
    from cli.redis_server import free_port
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    store = blobs.open_store("s3://bucket")
    t0 = time.monotonic()
    with pytest.raises(blobs.StoreError, match=r"s3://bucket: cannot read files/f: unreachable \(.*AWS_ENDPOINT_URL="):
        store.get("files/f")
    assert time.monotonic() - t0 < 3 * (5 + 30)  # the client's connect and read timeouts, three attempts


def test_local_that_cannot_write(tmp_path):
    (tmp_path / "not-a-dir").write_text("")
    store = blobs.open_store(str(tmp_path / "not-a-dir"))
    with pytest.raises(blobs.StoreError, match=f"file://{tmp_path}/not-a-dir: cannot write files/f"):
        store.writer("files/f")
    with pytest.raises(blobs.StoreError, match="cannot read files/f"):
        store.get("files/f")
