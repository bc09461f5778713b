"""Stream entry format: one Redis stream per job, flat string fields so `redis-cli XREAD`
stays readable.

    type=attempt  attempt worker shard lo hi          an attempt (re)starts shard `shard`, the
                                                      job's items [lo, hi)
    type=delta    index sample delta delta_ids [logprobs]
                                                      new text / token ids of one sample
                                                      (logprobs: the records of delta_ids)
    type=final    index sample delta delta_ids text token_ids finish_reason usage [logprobs]
                  [prompt_logprobs]                   the sample finished; `delta*` is the
                                                      last piece, `text`/`token_ids` the whole,
                                                      `logprobs` the whole sample's records,
                                                      `prompt_logprobs` its prompt's (asked with
                                                      `prompt_logprobs: k`: one per prompt
                                                      token, the first's logprob null)
                  [tool_calls content]                a chat item with tools: the calls parsed
                                                      from `text` ([{"name", "arguments"}]) and
                                                      the text that is not a call
                  [stop]                              the stop string that ended it
    type=error    index sample error                  the sample failed (e.g. prompt too long)
    type=status   status [done total failed error]    the job's status changed

delta, final and error entries of an item that has a `custom_id` carry it too.

A job that keeps its items in the blob store (past FANOUT_ITEMS_STORE_BYTES, and every
dataset and batch file) has its stream trimmed as its shards end: it holds the entries of
the attempts still running (from the oldest one's `attempt` entry on) and the last
status, not those of finished shards, whose items are in GET /v1/jobs/{id}/results. The
info hash's `trimmed` is the id of the newest entry dropped. An SSE follower whose last
entry is older than that is told so, in id order, by a synthetic event (it is never in
the stream itself):

    type=trimmed  through results                     entries up to `through` may be gone:
                                                      fetch `results` for the finished items

Rebuilding: concatenate `delta` of the delta and final entries of each (index, sample).
An `attempt` entry of a shard after its first (`attempt` > 1) means a retry: drop the
partial deltas of its items' samples that have no final yet (the new attempt regenerates
them from the start, same seed). Shards run at once on several workers: their entries
interleave, each with its global item index.
Integers are decimal strings; `delta_ids`, `token_ids`, `usage` and `logprobs` are JSON.
`logprobs` is there only for samples that asked (`logprobs: true`): one record per token,
`{"token_id", "token", "logprob", "top_logprobs": [{"token_id", "token", "logprob"}, ...]}`
(see worker/engine/events.py).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

ATTEMPT, DELTA, FINAL, ERROR, STATUS, TRIMMED = "attempt", "delta", "final", "error", "status", "trimmed"
TERMINAL = frozenset({"succeeded", "failed", "canceled"})

_INTS = frozenset({"index", "sample", "attempt", "done", "total", "failed", "shard", "lo", "hi"})
_JSON = frozenset({"delta_ids", "token_ids", "usage", "logprobs", "prompt_logprobs", "tool_calls"})


def worker_ref(name: str) -> str:
    """What a job's readers see of the worker named `name`: an opaque id, the same for all of
    its attempts (so a reader tells workers apart), without the host or PID a default name
    carries. The worker logs it at start, for the operator to match."""
    return "w-" + hashlib.blake2b(name.encode(), digest_size=6).hexdigest()


def attempt(number: int, worker: str, shard: int, lo: int, hi: int) -> dict[str, str]:
    """Attempt `number` of shard `shard` (items [lo, hi)) starts on the worker named `worker`."""
    return {"type": ATTEMPT, "attempt": str(number), "worker": worker_ref(worker), "shard": str(shard),
            "lo": str(lo), "hi": str(hi)}


def delta(index: int, sample: int, text: str, token_ids: list[int],
          logprobs: list[dict] | None = None, custom_id: str | None = None) -> dict[str, str]:
    return _optional({"type": DELTA, "index": str(index), "sample": str(sample), "delta": text,
                      "delta_ids": json.dumps(token_ids)}, custom_id, logprobs=logprobs)


# A stored record's fields that only some samples have (store.sample_record), in the final
# entry as they are in the record.
OPTIONAL = ("logprobs", "prompt_logprobs", "tool_calls", "content", "stop", "embedding")
TEXTS = ("content", "stop", "embedding")  # the optional fields that are text, not JSON


def final(index: int, sample: int, text_delta: str, ids_delta: list[int], record: dict,
          custom_id: str | None = None) -> dict[str, str]:
    """`record` is the stored sample (see results.store.sample_record)."""
    return _optional({"type": FINAL, "index": str(index), "sample": str(sample), "delta": text_delta,
                      "delta_ids": json.dumps(ids_delta), "text": record["text"],
                      "token_ids": json.dumps(record["token_ids"]),
                      "finish_reason": record["finish_reason"], "usage": json.dumps(record["usage"])},
                     custom_id, **{k: record.get(k) for k in OPTIONAL})


def _optional(fields: dict[str, str], custom_id: str | None, **extra) -> dict[str, str]:
    """Only samples that asked carry logprobs (or prompt logprobs, or tool calls), only items
    that have one their custom_id: the other entries stay small. TEXTS are text, the rest
    JSON."""
    for k, v in extra.items():
        if v is not None:
            fields[k] = v if k in TEXTS else json.dumps(v)
    if custom_id is not None:
        fields["custom_id"] = custom_id
    return fields


def error(index: int, sample: int, message: str, custom_id: str | None = None) -> dict[str, str]:
    return _optional({"type": ERROR, "index": str(index), "sample": str(sample), "error": message}, custom_id)


def status(value: str, **extra: Any) -> dict[str, str]:
    fields = {"type": STATUS, "status": value}
    fields.update({k: str(v) for k, v in extra.items() if v is not None})
    return fields


def trimmed(through: str, job_id: str) -> dict[str, str]:
    return {"type": TRIMMED, "through": through, "results": f"/v1/jobs/{job_id}/results"}


def tell_trimmed(out: list[tuple[str, dict]], last: str, newest: str | None, told: str | None,
                 job_id: str) -> str | None:
    """A follower's next entries `out` (id, decoded entry), read after `last`; `newest`:
    the newest entry trimmed (the info hash's `trimmed`), read after them; `told`: the last
    one the follower was told of. When entries after `last` may be gone, the trimmed event
    goes into `out`, in id order (after the entries read before that trim). Returns what
    the follower has now been told of."""
    if newest is None or newest == told or pos(last) >= pos(newest):
        return told
    at = sum(pos(i) <= pos(newest) for i, _ in out)
    out.insert(at, (newest, trimmed(newest, job_id)))
    return newest


def pos(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("<ms>-<seq>") as a sortable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def decode(fields: dict) -> dict[str, Any]:
    """Stream entry fields (bytes or str) -> typed dict."""
    out: dict[str, Any] = {}
    for k, v in fields.items():
        k, v = _s(k), _s(v)
        if k in _INTS:
            out[k] = int(v)
        elif k in _JSON:
            out[k] = json.loads(v)
        else:
            out[k] = v
    return out


def is_terminal(entry: dict[str, Any]) -> bool:
    return entry.get("type") == STATUS and entry.get("status") in TERMINAL
