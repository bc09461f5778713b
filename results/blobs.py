"""The blob store: what Redis should not hold (batch input, output and error files) in a
local folder (the default: one host, or a volume every process mounts) or an S3-compatible
bucket (FANOUT_STORAGE_URL=s3://bucket/prefix, credentials and endpoint from the standard
AWS_* variables: AWS_ENDPOINT_URL for MinIO and the like).

S3 goes through boto3: the reference client, kept by AWS, that reads every AWS_* variable
(keys, profiles, roles, endpoint, region) the way the rest of a user's tools do, and whose
low-level calls let a write stream in parts of PART bytes, so no process holds a whole
file. (s3fs pins aiobotocore and brings an event loop per call into sync code; obstore
is younger and less known to operators.)

Contract: `writer(key)` streams bytes into an object that appears whole at commit or not
at all; `get(key)` opens the object (Missing, or StoreError, before any byte) and yields
its bytes in chunks. Every failure of the store itself is a StoreError whose message names the store
and what to check, so a job or a request can say it as is."""
from __future__ import annotations

import os
import uuid
from typing import Iterable, Iterator
from urllib.parse import urlparse

from . import keys

CHUNK = 1 << 20  # bytes per chunk read
ORPHAN = 3600  # seconds: what is being written gets this long to get its owner (a file's object, a job), or is swept
PART = 8 << 20  # bytes per S3 part (S3's least is 5 MiB): a writer holds at most this much


class StoreError(Exception):
    """The store is unreachable or refuses (no such bucket, no credentials, denied, disk full)."""


class Missing(KeyError):
    """No object under this key."""


class Gone(StoreError):
    """An object that was written, and that something still needs, is not in the store: lost
    for good (waiting does not bring it back, unlike the store being away)."""


class OtherStore(ValueError):
    """This process's store is not the one the others of its Redis use."""


def same_store(redis, store) -> None:
    """At an API process's or a worker's start: its store is the one the others of this
    Redis use (the first one's, in keys.storage), or OtherStore, which stops it."""
    redis.set(keys.storage(), store.url, nx=True)
    used = (redis.get(keys.storage()) or b"").decode()
    if used != store.url:
        raise OtherStore(f"FANOUT_STORAGE_URL is {store.url} but this Redis's files are in {used} "
                         f"({keys.storage()}): every API process and worker must use the same blob store. "
                         f"To move to another one, stop them all and delete that key; what is in {used} "
                         f"is then no longer served")


def lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a stream of chunks, without their b"\\n" (a last line without one too)."""
    rest = b""
    for chunk in chunks:
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        yield from parts
    if rest:
        yield rest


def _key_ok(key: str) -> str:
    # Keys are made by this service; a key that could climb out of the root is a bug.
    if not key or key.startswith("/") or ".." in key.split("/"):
        raise ValueError(f"bad blob key {key!r}")
    return key


class Writer:
    """One object being written: write() the bytes, then commit() (it appears whole) or
    abort() (nothing appears); as a context manager, an exception aborts and leaving
    commits what was neither committed nor aborted."""
    size = 0
    closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after commit or abort"
        self._write(data)
        self.size += len(data)

    def commit(self) -> int:
        assert not self.closed, "commit after commit or abort"
        self.closed = True
        self._commit()
        return self.size

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self._abort()

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        if kind is not None:
            self.abort()
        elif not self.closed:
            self.commit()


class LocalStore:
    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = "file://" + self.root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, _key_ok(key))

    def error(self, what: str, e: OSError) -> StoreError:
        return StoreError(f"blob store {self.url}: {what}: {e.strerror or e} (FANOUT_STORAGE_URL)")

    def writer(self, key: str) -> Writer:
        return _LocalWriter(self, key, self._path(key))

    def get(self, key: str) -> Iterator[bytes]:
        try:
            f = open(self._path(key), "rb")
        except FileNotFoundError:
            raise Missing(key) from None
        except OSError as e:
            raise self.error(f"cannot read {key}", e) from None
        return self._chunks(f, key)

    def _chunks(self, f, key: str) -> Iterator[bytes]:
        with f:
            while True:
                try:
                    chunk = f.read(CHUNK)
                except OSError as e:
                    raise self.error(f"cannot read {key}", e) from None
                if not chunk:
                    return
                yield chunk

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self.error(f"cannot delete {key}", e) from None


class _LocalWriter(Writer):
    # A temporary file beside the object, renamed onto it at commit: whole or not at all.
    def __init__(self, store: LocalStore, key: str, path: str):
        self.store, self.key, self.path = store, key, path
        self.tmp = f"{path}.{uuid.uuid4().hex}.part"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.f = open(self.tmp, "wb")
        except OSError as e:
            raise store.error(f"cannot write {key}", e) from None

    def _write(self, data: bytes) -> None:
        try:
            self.f.write(data)
        except OSError as e:
            self.abort()
            raise self.store.error(f"cannot write {self.key}", e) from None

    def _commit(self) -> None:
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            os.replace(self.tmp, self.path)
        except OSError as e:
            self._abort()
            raise self.store.error(f"cannot write {self.key}", e) from None

    def _abort(self) -> None:
        try:
            self.f.close()  # flushes what is buffered: on a full disk that fails again
        except OSError:
            pass
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


class S3Store:
    def __init__(self, bucket: str, prefix: str):
        import boto3
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        # Bounded waits: a store that hangs is a StoreError in about a minute, not a stuck request.
        self.client = boto3.client("s3", config=Config(connect_timeout=5, read_timeout=30,
                                                       retries={"max_attempts": 3, "mode": "standard"}))

    def name(self, key: str) -> str:
        return f"{self.prefix}/{_key_ok(key)}" if self.prefix else _key_ok(key)

    def error(self, what: str, e: Exception) -> StoreError:
        from botocore.exceptions import ClientError, NoCredentialsError

        if isinstance(e, NoCredentialsError):
            why = "no credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile or role)"
        elif isinstance(e, ClientError):
            code = e.response.get("Error", {}).get("Code", "")
            why = {"NoSuchBucket": f"bucket {self.bucket!r} does not exist",
                   "AccessDenied": "access denied (check the credentials' rights on the bucket)",
                   "InvalidAccessKeyId": "the access key is not known to the store (AWS_ACCESS_KEY_ID)",
                   "SignatureDoesNotMatch": "the secret key is wrong (AWS_SECRET_ACCESS_KEY)"}.get(code, str(e))
        else:
            why = f"unreachable ({e}; AWS_ENDPOINT_URL={os.environ.get('AWS_ENDPOINT_URL') or 'unset'})"
        return StoreError(f"blob store {self.url}: {what}: {why}")

    def call(self, what: str, method: str, **kw):
        """client.<method>(Bucket=..., **kw), its failures as Missing or StoreError."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, method)(Bucket=self.bucket, **kw)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise Missing(kw.get("Key")) from None
            raise self.error(what, e) from None
        except BotoCoreError as e:
            raise self.error(what, e) from None

    def writer(self, key: str) -> Writer:
        return _S3Writer(self, key)

    def get(self, key: str) -> Iterator[bytes]:
        body = self.call(f"cannot read {key}", "get_object", Key=self.name(key))["Body"]
        return self._chunks(body, key)

    def _chunks(self, body, key: str) -> Iterator[bytes]:
        from botocore.exceptions import BotoCoreError

        with body:
            try:
                yield from body.iter_chunks(CHUNK)
            except BotoCoreError as e:
                raise self.error(f"cannot read {key}", e) from None

    def delete(self, key: str) -> None:
        self.call(f"cannot delete {key}", "delete_object", Key=self.name(key))


class _S3Writer(Writer):
    # Up to PART bytes held; past that a multipart upload, one part per PART bytes, that
    # appears only when completed (a small object is one put_object at commit).
    def __init__(self, store: S3Store, key: str):
        self.store, self.key, self.name = store, key, store.name(key)
        self.what = f"cannot write {key}"
        self.buf, self.upload, self.parts = bytearray(), None, []

    def _call(self, method: str, **kw):
        try:
            return self.store.call(self.what, method, Key=self.name, **kw)
        except StoreError:
            self.closed = True
            self._abort()
            raise

    def _send_part(self) -> None:
        n = len(self.parts) + 1
        part = self._call("upload_part", UploadId=self.upload, PartNumber=n, Body=bytes(self.buf))
        self.parts.append({"PartNumber": n, "ETag": part["ETag"]})
        self.buf.clear()

    def _write(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) >= PART:
            if self.upload is None:
                self.upload = self._call("create_multipart_upload")["UploadId"]
            self._send_part()

    def _commit(self) -> None:
        if self.upload is None:
            self._call("put_object", Body=bytes(self.buf))
        else:
            if self.buf:
                self._send_part()
            self._call("complete_multipart_upload", UploadId=self.upload, MultipartUpload={"Parts": self.parts})
            self.upload = None

    def _abort(self) -> None:
        self.buf.clear()
        upload, self.upload = self.upload, None
        if upload is not None:  # the parts must not linger (and cost)
            try:
                self.store.call(self.what, "abort_multipart_upload", Key=self.name, UploadId=upload)
            except StoreError:
                pass  # the bucket's rule for incomplete uploads is the backstop (docs/deployment.md)


Store = LocalStore | S3Store


def open_store(url: str) -> Store:
    """The store at `url`: s3://bucket[/prefix], file:///path or a plain path."""
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"FANOUT_STORAGE_URL: {url!r} names no bucket (s3://bucket/prefix)")
        return S3Store(parsed.netloc, parsed.path)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"FANOUT_STORAGE_URL: {url!r}: a file URL names no host (file:///path)")
        return LocalStore(parsed.path)
    if parsed.scheme == "" and url:
        return LocalStore(url)
    raise ValueError(f"FANOUT_STORAGE_URL: {url!r}: give s3://bucket/prefix or file:///path")
