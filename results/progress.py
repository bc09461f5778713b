"""The job's info hash: its shape (written at submit) and progress counters (the worker
bumps them in the same transaction that stores the finished samples)."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from . import keys

_INTS = ("total", "samples", "done", "failed", "samples_done", "prompt_tokens",
         "cached_tokens", "completion_tokens", "attempt", "seed", "steps", "max_batch_jobs")


def timestamp() -> str:
    """Now, as the info hash's created_at / started_at / ended_at read (UTC, ISO 8601)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def read(redis, job_id: str) -> dict[str, Any] | None:
    raw = redis.hgetall(keys.info(job_id))
    return decode(raw) if raw else None


def decode(raw: dict) -> dict[str, Any]:
    d = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
         for k, v in raw.items()}
    out: dict[str, Any] = {k: int(d.get(k, 0) or 0) for k in _INTS}
    out["ns"] = json.loads(d["ns"]) if "ns" in d else []
    out["metadata"] = json.loads(d["metadata"]) if "metadata" in d else {}
    out["priority"] = d.get("priority", "normal")
    out["error"] = d.get("error") or None
    out["run_at"] = d.get("run_at") or None
    out["model"] = d.get("model") or None  # the worker's, written when it starts the job
    return out


def count_sample(counts, record: dict, item_done: bool, item_failed: bool) -> None:
    """Add one finished sample to `counts` (a Counter of info-hash increments; the worker's
    batch sends them with the step's other writes)."""
    counts["samples_done"] += 1
    for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        counts[name] += record["usage"].get(name, 0)
    if item_done:
        counts["done"] += 1
        counts["failed"] += item_failed
