"""Finished samples, one Redis hash per job (field "index:sample" -> JSON record); for a
job that keeps its items in the blob store, each done shard's in one object there instead
(`keep`), so Redis holds the results of the shards in flight, not of the job.

The worker writes a record before it announces the sample on the stream, so
`GET /v1/jobs/{id}/results` and a retried attempt can rely on it.
"""
from __future__ import annotations

import array
import base64
import json
import sys
from bisect import bisect_left, bisect_right
from typing import Any

from . import blobs, keys


def sample_record(text: str, token_ids: list[int], finish_reason: str, usage: dict | None,
                  error: str | None = None, logprobs: list[dict] | None = None,
                  **optional) -> dict[str, Any]:
    """`logprobs`: one record per token of token_ids (worker/engine/events.py), None when
    not asked. `optional` (results.events.OPTIONAL), only in the records of samples that
    have them: `prompt_logprobs`, one per prompt token (the first's logprob null; a scoring
    job's records are mostly these); for a chat item with tools, `tool_calls` (the calls
    parsed out of `text`, [{"name", "arguments" JSON text}]) and `content` (the text that is
    not a call, or null); `stop`, the stop string that ended it; an embedding job's
    `embedding`, the vector as base64 of its float32 values (little-endian: OpenAI's
    `encoding_format: base64`), its text and token_ids empty."""
    rec = {"text": text, "token_ids": token_ids, "finish_reason": finish_reason,
           "usage": usage or {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0},
           "error": error, "logprobs": logprobs}
    rec.update((k, v) for k, v in optional.items() if v is not None)
    return rec


def put(redis, job_id: str, index: int, sample: int, record: dict) -> None:
    """HSET one record; `redis` may be a pipeline (the worker batches a step's writes)."""
    redis.hset(keys.results(job_id), f"{index}:{sample}", json.dumps(record))


def stored(redis, job_id: str, ns, lo: int, hi: int) -> set[tuple[int, int]]:
    """(index, sample) pairs of items [lo, hi) already stored: a retried shard skips them."""
    pairs = [(i, j) for i in range(lo, hi) for j in range(ns[i])]
    if not pairs:
        return set()
    have = redis.hmget(keys.results(job_id), [f"{i}:{j}" for i, j in pairs])
    return {p for p, v in zip(pairs, have) if v is not None}


def _fields(ns, lo: int, hi: int) -> list[str]:
    return [f"{i}:{j}" for i in range(lo, hi) for j in range(ns[i])]


def _from_redis(redis, job_id: str, ns, lo: int, hi: int, custom: list[str | None] | None) -> list[dict[str, Any]]:
    """Items [lo, hi) from the results hash; `custom`: their custom ids (None: none)."""
    fields = _fields(ns, lo, hi)
    values = redis.hmget(keys.results(job_id), fields) if fields else []
    items, pos = [], 0
    for i in range(lo, hi):
        samples = []
        for j in range(ns[i]):
            raw = values[pos]
            pos += 1
            if raw is not None:
                samples.append({"sample": j, **json.loads(raw)})
        items.append({"index": i, "custom_id": custom[i - lo] if custom else None, "samples": samples})
    return items


def keep(redis, blob_store, job_id: str, ns, k: int, lo: int, hi: int, custom: list[str | None] | None):
    """A done shard's results into the blob store (keys.results_blob; StoreError if it
    cannot take them). Returns what its settle transaction adds (`on_pipe`): the records
    out of the results hash and the shard marked kept, so a reader finds them in one place
    or the other, never neither."""
    items = _from_redis(redis, job_id, ns, lo, hi, custom)
    with blob_store.writer(keys.results_blob(job_id, k)) as w:
        for item in items:
            w.write(json.dumps(item).encode() + b"\n")
    fields = _fields(ns, lo, hi)

    def on_pipe(pipe) -> None:
        pipe.setbit(keys.kept(job_id), k, 1)
        if fields:
            pipe.hdel(keys.results(job_id), *fields)
    return on_pipe


def _kept(blob_store, job_id: str, k: int) -> list[dict[str, Any]]:
    key = keys.results_blob(job_id, k)
    try:
        return [json.loads(line) for line in blobs.lines(blob_store.get(key))]
    except blobs.Missing:  # written before the shard was marked kept: the store lost it
        raise blobs.Gone(f"shard {k}'s results are gone from the blob store ({key})") from None


def _custom_ids(redis, blob_store, job_id: str, info: dict, k: int, lo: int, hi: int) -> list[str | None] | None:
    """Items [lo, hi) of shard k: their custom ids from the job's list, or from the entries
    of the shard's items in the blob store (items.Builder); None when they have none."""
    first = info["bounds"][k]
    custom = [c.decode() or None for c in redis.lrange(keys.custom_ids(job_id), lo, hi - 1)]
    if custom or info.get("items_in") != "store":
        return custom or None
    try:
        rows = json.loads(b"".join(blob_store.get(keys.items_blob(job_id, k))))
    except blobs.Missing:  # the job expired meanwhile
        return None
    rows = rows[lo - first:hi - first]
    return [r.get("c") for r in rows] if any("c" in r for r in rows) else None


def page(redis, blob_store, job_id: str, info: dict, offset: int, limit: int) -> list[dict[str, Any]]:
    """Items [offset, offset + limit) in index order, each with its custom_id (None without
    one) and its stored samples: from the results hash, or, for the shards kept in the blob
    store (keep), from their objects there. `info`: the job's (progress.read). An embedding
    is a list of floats here (stored as base64: sample_record)."""
    ns = info["ns"]
    end = min(offset + limit, len(ns))
    if offset >= end:
        return []
    if info.get("items_in") != "store":
        custom = [c.decode() or None for c in redis.lrange(keys.custom_ids(job_id), offset, end - 1)]
        return _vectors(_from_redis(redis, job_id, ns, offset, end, custom))
    bounds = info["bounds"]
    first = bisect_right(bounds, offset) - 1
    last = bisect_left(bounds, end)  # shards [first, last) hold the page
    flags = redis.getrange(keys.kept(job_id), first // 8, (last - 1) // 8)
    items = []
    for k in range(first, last):
        lo, hi = max(bounds[k], offset), min(bounds[k + 1], end)
        byte = flags[k // 8 - first // 8] if k // 8 - first // 8 < len(flags) else 0
        if byte >> (7 - k % 8) & 1:
            items += [it for it in _kept(blob_store, job_id, k) if lo <= it["index"] < hi]
        else:
            items += _from_redis(redis, job_id, ns, lo, hi, _custom_ids(redis, blob_store, job_id, info, k, lo, hi))
    return _vectors(items)


def vector(b64: str) -> list[float]:
    """A stored embedding (base64 of little-endian float32) as floats."""
    a = array.array("f", base64.b64decode(b64))
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


def _vectors(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for item in items:
        for s in item["samples"]:
            if isinstance(s.get("embedding"), str):
                s["embedding"] = vector(s["embedding"])
    return items
