"""Service settings, read from the environment (the CLI's flags set the same variables).
Shared by the API, the worker and the cron scheduler (jobs/: neither imports the other)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field


def _int(name: str, default: int, least: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: must be an integer, got {raw!r}") from None
    if least is not None and value < least:
        raise ValueError(f"{name}: must be at least {least}, got {value}")
    return value


@dataclass(slots=True)
class Settings:
    redis_url: str = "redis://localhost:6379/0"
    max_batch: int = 100_000  # items per job
    max_new_tokens: int = 4096  # per sample
    max_n: int = 64  # samples per item
    max_body_bytes: int = 32 * 1024 * 1024
    # A finished job's status, stream and results live this long (seconds) after it ends.
    result_ttl: int = 7 * 24 * 3600
    # An online request's job (a chat, completion, response or message the HTTP request waits
    # for) lives this long after it ends instead: its answer was delivered already.
    online_ttl: int = 60
    # A job running longer than this is aborted and counted as a failed attempt.
    job_timeout: int = 24 * 3600
    # Attempts after the first one, used when a worker dies or hits an engine error mid-job.
    job_retries: int = 2
    # A running job's execution expires this long (seconds) after its worker's last heartbeat
    # (sent every third of it); then any worker retries the job, or fails it. Above the
    # longest engine step, or a stalled worker loses its jobs.
    heartbeat_ttl: int = 30
    # A shard whose inputs are away (the blob store down or denying) is queued again this
    # many seconds on, no strike, for as long as they stay away.
    shard_hold: int = 10
    # An API process validating a dataset job holds it this long (seconds) between renewals;
    # one that died is replaced by another's sweep once it has run out.
    validation_lease: int = 15
    # A job is cut into shards of about this many samples (whole items: one with more is a
    # shard of its own) that any worker takes; each job keeps at most `shard_window` of them
    # queued (more are released as workers take them), so jobs of one priority interleave.
    shard_samples: int = 64
    shard_window: int = 8
    # An idle SSE connection gets a comment this often (seconds); proxies keep it open.
    sse_keepalive: int = 15
    # Streams one API process follows at once (SSE followers, chats and completions); past
    # it a new one is refused with a 503 (api/streams.py).
    max_streams: int = 4096
    # OpenAI batches: requests per input file and its size (OpenAI's limits), and how long
    # `completion_window: "24h"` lasts here (seconds; lines not done by then expire).
    batch_max_requests: int = 50_000
    batch_max_file_bytes: int = 200 * 1024 * 1024
    batch_window: int = 24 * 3600
    # Where files live (results/blobs.py): a folder, or s3://bucket/prefix with the AWS_*
    # variables. The default folder serves one host; more hosts need a bucket (or a volume
    # every process mounts).
    # A job whose items (as JSON) take more than this many bytes keeps them in the blob
    # store, one object per shard, instead of Redis; its workers read them from there.
    items_store_bytes: int = 1 << 20
    # A dataset job's `input_url` may name a file:// under this folder (unset: none may).
    input_root: str | None = None
    # Webhook URLs may name only these hosts (`host`, `host:port` or `*` for any public one;
    # api/webhooks.py); none: webhooks are off.
    webhook_hosts: tuple[str, ...] = ()
    storage_url: str = field(default_factory=lambda: "file://" + os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "fanout", "blobs"))

    @classmethod
    def from_env(cls) -> "Settings":
        d = cls()
        return cls(
            redis_url=os.environ.get("REDIS_URL") or d.redis_url,
            max_batch=_int("FANOUT_MAX_BATCH", d.max_batch),
            max_new_tokens=_int("FANOUT_MAX_NEW_TOKENS", d.max_new_tokens),
            max_n=_int("FANOUT_MAX_N", d.max_n),
            max_body_bytes=_int("FANOUT_MAX_BODY_BYTES", d.max_body_bytes),
            result_ttl=_int("FANOUT_RESULT_TTL", d.result_ttl),
            online_ttl=_int("FANOUT_ONLINE_TTL", d.online_ttl, least=1),
            job_timeout=_int("FANOUT_JOB_TIMEOUT", d.job_timeout),
            job_retries=_int("FANOUT_JOB_RETRIES", d.job_retries),
            heartbeat_ttl=_int("FANOUT_HEARTBEAT_TTL", d.heartbeat_ttl),
            shard_hold=_int("FANOUT_SHARD_HOLD", d.shard_hold, least=1),
            validation_lease=_int("FANOUT_VALIDATION_LEASE", d.validation_lease, least=2),
            shard_samples=_int("FANOUT_SHARD_SAMPLES", d.shard_samples, least=1),
            shard_window=_int("FANOUT_SHARD_WINDOW", d.shard_window, least=1),
            sse_keepalive=_int("FANOUT_SSE_KEEPALIVE", d.sse_keepalive),
            max_streams=_int("FANOUT_MAX_STREAMS", d.max_streams, least=1),
            batch_max_requests=_int("FANOUT_BATCH_MAX_REQUESTS", d.batch_max_requests),
            batch_max_file_bytes=_int("FANOUT_BATCH_MAX_FILE_BYTES", d.batch_max_file_bytes),
            batch_window=_int("FANOUT_BATCH_WINDOW", d.batch_window),
            items_store_bytes=_int("FANOUT_ITEMS_STORE_BYTES", d.items_store_bytes, least=0),
            input_root=os.environ.get("FANOUT_INPUT_ROOT") or d.input_root,
            webhook_hosts=tuple(h.strip() for h in os.environ.get("FANOUT_WEBHOOK_HOSTS", "").split(",") if h.strip()),
            storage_url=os.environ.get("FANOUT_STORAGE_URL") or d.storage_url,
        )
