"""Read a job's stream from any entry id (resume), and rebuild outputs from entries."""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from . import events, keys


# Set a stream's followed flag unless its job is closed (the close deleted it; a renewal must
# not bring it back). KEYS: closed, the flag. ARGV: its TTL.
_MARK = "if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('SET', KEYS[2], 1, 'EX', ARGV[1]) end"


def mark_followed(pipe, stream_key: str) -> None:
    """Queue the setting of a job stream's followed flag (keys.followed) on a client or a
    pipeline, sync or async."""
    return pipe.eval(_MARK, 2, keys.closed(keys.job_of_stream(stream_key)), keys.followed(stream_key),
                     keys.FOLLOWED_TTL)


def follow(redis, job_id: str, last_id: str = "0", timeout: float | None = None,
           block_ms: int = 1000) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (entry id, entry) after `last_id` until the job's terminal status entry, and
    the trimmed event (results/events.py) where entries after the last one yielded may be
    gone. Raises TimeoutError if that takes longer than `timeout` seconds. `block_ms` must
    stay under the client's socket timeout (redis-py's default: 5 s), or an idle XREAD
    times out. While it follows, the stream's followed flag is set (keys.followed): the
    job's workers send its deltas, not only its finals."""
    deadline = None if timeout is None else time.monotonic() + timeout
    key, told, marked = keys.stream(job_id), None, 0.0
    while True:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id}: no terminal status within {timeout}s")
        if time.monotonic() - marked >= keys.FOLLOWED_RENEW:
            mark_followed(redis, key)
            marked = time.monotonic()
        resp = redis.xread({key: last_id}, count=1000, block=block_ms)
        if not resp:
            continue
        out = [(_text(i), events.decode(f)) for i, f in resp[0][1]]
        newest = redis.hget(keys.info(job_id), "trimmed")
        told = events.tell_trimmed(out, last_id, newest and _text(newest), told, job_id)
        for last_id, entry in out:
            yield last_id, entry
            if events.is_terminal(entry):
                return


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else v


@dataclass(slots=True)
class Rebuilt:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[dict] | None = None  # when the sample asked
    prompt_logprobs: list[dict] | None = None  # when the sample asked, from its final


class Rebuilder:
    """Applies stream entries in order; `outputs[(index, sample)]` holds what the stream
    says about each sample, `status` the last job status."""

    def __init__(self):
        self.outputs: dict[tuple[int, int], Rebuilt] = {}
        self.status: str | None = None

    def apply(self, entry: dict[str, Any]) -> None:
        kind = entry["type"]
        if kind == events.ATTEMPT:
            # A new attempt regenerates its shard's unfinished samples from their start.
            lo, hi = entry["lo"], entry["hi"]
            self.outputs = {k: v for k, v in self.outputs.items()
                            if v.finish_reason or not lo <= k[0] < hi}
        elif kind == events.STATUS:
            self.status = entry["status"]
        elif kind in (events.DELTA, events.FINAL, events.ERROR):
            out = self.outputs.setdefault((entry["index"], entry["sample"]), Rebuilt())
            if kind == events.ERROR:
                out.finish_reason, out.error = "error", entry["error"]
                return
            out.text += entry["delta"]
            out.token_ids += entry["delta_ids"]
            if kind == events.FINAL:
                out.finish_reason = entry["finish_reason"]
                out.logprobs = entry.get("logprobs")  # the whole sample's
                out.prompt_logprobs = entry.get("prompt_logprobs")
            elif "logprobs" in entry:
                out.logprobs = (out.logprobs or []) + entry["logprobs"]
