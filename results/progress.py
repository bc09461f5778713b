"""The job's info hash: its shape (written at submit) and progress counters (the worker
bumps them in the same transaction that stores the finished samples)."""
from __future__ import annotations

import json
from bisect import bisect_right
from datetime import datetime, timezone
from typing import Any

from . import keys

_INTS = ("total", "samples", "done", "failed", "samples_done", "prompt_tokens",
         "cached_tokens", "completion_tokens", "attempt", "seed", "steps", "max_batch_jobs")


class Ns:
    """Samples per item, run-length encoded ([[n, count], ...] in the info hash's `ns`): a
    million-item job of one `n` is one run, not a million numbers to store and parse."""

    def __init__(self, runs: list[list[int]] | None = None):
        self.runs = runs or []
        self.starts, self.size, self.samples = [], 0, 0
        for n, count in self.runs:
            self.starts.append(self.size)
            self.size += count
            self.samples += n * count

    @classmethod
    def of(cls, ns) -> "Ns":
        out = cls()
        for n in ns:
            out.append(n)
        return out

    @classmethod
    def decode(cls, text: str | None) -> "Ns":
        raw = json.loads(text) if text else []
        if raw and isinstance(raw[0], int):  # written by an earlier version: one number per item
            return cls.of(raw)
        return cls(raw)

    def encode(self) -> str:
        return json.dumps(self.runs, separators=(",", ":"))

    def append(self, n: int, count: int = 1) -> None:
        """`count` more items of `n` samples each, after the others."""
        if self.runs and self.runs[-1][0] == n:
            self.runs[-1][1] += count
        else:
            self.runs.append([n, count])
            self.starts.append(self.size)
        self.size += count
        self.samples += n * count

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.size:
            raise IndexError(i)
        return self.runs[bisect_right(self.starts, i) - 1][0]

    def __iter__(self):
        for n, count in self.runs:
            for _ in range(count):
                yield n

    def __eq__(self, other) -> bool:
        return list(self) == list(other)


class Bounds:
    """Shard bounds, shard k holding items [b[k], b[k + 1]), kept as the shards' sizes
    run-length encoded (an Ns of items per shard; [[size, count], ...] in the info hash's
    `bounds`): a job of one `n` is cut into shards of one size (the last one shorter), two
    runs however many shards it has, so a claim or a status read parses a few numbers, not
    one per shard. A sequence of the shards + 1 bounds: b[k] in O(log runs), and bisect
    works on it."""

    def __init__(self, runs: list[list[int]] | None = None):
        self.sizes = Ns()  # sizes.starts: each run's first shard
        self.offsets: list[int] = []  # each run's first item
        for size, count in runs or []:
            self.add(size, count)

    @classmethod
    def of(cls, bounds: list[int]) -> "Bounds":
        out = cls()
        for lo, hi in zip(bounds, bounds[1:]):
            out.add(hi - lo)
        return out

    @classmethod
    def decode(cls, text: str | None) -> "Bounds":
        raw = json.loads(text) if text else []
        if raw and isinstance(raw[0], int):  # written by an earlier version: every bound
            return cls.of(raw)
        return cls(raw)

    def encode(self) -> str:
        return self.sizes.encode()

    @property
    def shards(self) -> int:
        return len(self.sizes)

    @property
    def items(self) -> int:
        return self.sizes.samples

    def add(self, size: int, count: int = 1) -> None:
        """`count` more shards of `size` items, after the others."""
        if not self.sizes.runs or self.sizes.runs[-1][0] != size:
            self.offsets.append(self.items)  # a new run starts here
        self.sizes.append(size, count)

    def __len__(self) -> int:
        return self.shards + 1

    def __getitem__(self, k: int) -> int:
        if k < 0:
            k += self.shards + 1
        if not 0 <= k <= self.shards:
            raise IndexError(k)
        if not self.offsets:
            return 0
        r = bisect_right(self.sizes.starts, k) - 1
        return self.offsets[r] + (k - self.sizes.starts[r]) * self.sizes.runs[r][0]

    def __iter__(self):
        yield 0
        b = 0
        for size in self.sizes:
            b += size
            yield b

    def __eq__(self, other) -> bool:
        return list(self) == list(other)


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
    out["ns"] = Ns.decode(d.get("ns"))
    out["bounds"] = Bounds.decode(d.get("bounds"))  # shard k: items [bounds[k], bounds[k + 1])
    out["input_format"] = d.get("input_format")  # a dataset job's: "jsonl" or "parquet"
    out["items_in"] = d.get("items_in")  # "store": the job's items (and done shards' results) are in the blob store
    out["metadata"] = json.loads(d["metadata"]) if "metadata" in d else {}
    out["priority"] = d.get("priority", "normal")
    out["task"] = d.get("task", "generate")
    out["error"] = d.get("error") or None
    out["errors"] = json.loads(d["errors"]) if "errors" in d else None  # a dataset's lines at fault
    out["run_at"] = d.get("run_at") or None
    out["model"] = d.get("model") or None  # the model it runs on, fixed when it was submitted
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
