"""Finished samples, one Redis hash per job (field "index:sample" -> JSON record).

The worker writes a record before it announces the sample on the stream, so
`GET /v1/jobs/{id}/results` and a retried attempt can rely on it.
"""
from __future__ import annotations

import json
from typing import Any

from . import keys


def sample_record(text: str, token_ids: list[int], finish_reason: str, usage: dict | None,
                  error: str | None = None, logprobs: list[dict] | None = None,
                  **optional) -> dict[str, Any]:
    """`logprobs`: one record per token of token_ids (worker/engine/events.py), None when
    not asked. `optional` (results.events.OPTIONAL), only in the records of samples that
    have them: `prompt_logprobs`, one per prompt token (the first's logprob null; a scoring
    job's records are mostly these); for a chat item with tools, `tool_calls` (the calls
    parsed out of `text`, [{"name", "arguments" JSON text}]) and `content` (the text that is
    not a call, or null)."""
    rec = {"text": text, "token_ids": token_ids, "finish_reason": finish_reason,
           "usage": usage or {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0},
           "error": error, "logprobs": logprobs}
    rec.update((k, v) for k, v in optional.items() if v is not None)
    return rec


def put(redis, job_id: str, index: int, sample: int, record: dict) -> None:
    """HSET one record; `redis` may be a pipeline (the worker batches a step's writes)."""
    redis.hset(keys.results(job_id), f"{index}:{sample}", json.dumps(record))


def stored(redis, job_id: str, ns: list[int], lo: int, hi: int) -> set[tuple[int, int]]:
    """(index, sample) pairs of items [lo, hi) already stored: a retried shard skips them."""
    pairs = [(i, j) for i in range(lo, hi) for j in range(ns[i])]
    if not pairs:
        return set()
    have = redis.hmget(keys.results(job_id), [f"{i}:{j}" for i, j in pairs])
    return {p for p, v in zip(pairs, have) if v is not None}


def page(redis, job_id: str, ns: list[int], offset: int, limit: int) -> list[dict[str, Any]]:
    """Items [offset, offset + limit) in index order, each with its custom_id (None without
    one) and its stored samples."""
    indices = range(offset, min(offset + limit, len(ns)))
    fields = [f"{i}:{j}" for i in indices for j in range(ns[i])]
    values = redis.hmget(keys.results(job_id), fields) if fields else []
    custom = [c.decode() for c in redis.lrange(keys.custom_ids(job_id), offset, indices.stop - 1)] if indices else []
    items, pos = [], 0
    for i in indices:
        samples = []
        for j in range(ns[i]):
            raw = values[pos]
            pos += 1
            if raw is not None:
                samples.append({"sample": j, **json.loads(raw)})
        items.append({"index": i, "custom_id": custom[i - offset] or None if custom else None, "samples": samples})
    return items
