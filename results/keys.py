"""Redis key names, all derived from the job id so any API process can serve any job."""
from __future__ import annotations

PREFIX = "fanout"


def stream(job_id: str) -> str:
    """The job's event stream (XADD by the worker, XREAD by clients)."""
    return f"{PREFIX}:job:{job_id}:events"


def results(job_id: str) -> str:
    """Hash of finished samples: field "index:sample" -> JSON sample."""
    return f"{PREFIX}:job:{job_id}:results"


def info(job_id: str) -> str:
    """Hash of the job's shape and progress counters (totals, done, usage, error)."""
    return f"{PREFIX}:job:{job_id}"


def cancel(job_id: str) -> str:
    """Present when a cancel was requested; the worker checks it every engine step."""
    return f"{PREFIX}:job:{job_id}:cancel"


def closed(job_id: str) -> str:
    """Guard so exactly one terminal status entry is written to the stream."""
    return f"{PREFIX}:job:{job_id}:closed"


def idempotency(key: str) -> str:
    return f"{PREFIX}:idempotency:{key}"


def all_for(job_id: str) -> list[str]:
    """Every key a job owns (for expiry)."""
    return [stream(job_id), results(job_id), info(job_id), cancel(job_id), closed(job_id)]
