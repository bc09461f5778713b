"""An online request: a native job (one item per prompt) on the high-priority queue whose
stream the HTTP request follows. What every online surface shares (OpenAI's chat and text
completions, Anthropic's messages): submitting with the stream already followed, following
it to the job's end (canceling the job when the client goes away), and collecting the
samples' records. Each surface turns records and failures into its own shapes."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
from fastapi import Request

from results import events, keys
from worker.embedder.params import EmbedParams
from worker.engine.sampling_params import SamplingParams

from . import jobs, streams, submit
from .schemas import JobRequest


class Failed(Exception):
    """The request's job ended without its answer: `entry` is the stream entry that says how
    (an item's error, a `closed` entry: the key was revoked, or a terminal status)."""

    def __init__(self, entry: dict):
        super().__init__(entry.get("error") or entry.get("status") or entry.get("type"))
        self.entry = entry


@dataclass(slots=True)
class Online:
    job_id: str
    entries: AsyncIterator[dict]  # the job's stream entries (closing it cancels the job)


async def start(request: Request, model: str, items: dict, params: SamplingParams | EmbedParams, metadata: dict,
                disconnect: bool = True) -> Online:
    """Submit the job on `model` (`items`: JobInput's fields; an embedding job's with EmbedParams) and
    follow its stream. `disconnect`: end (and cancel) when the client goes away (a streamed
    response is ended by Starlette)."""
    st, tenant = request.app.state, request.state.tenant
    may_pass = tenant is None or tenant.may_use_high_priority  # a key's rights hold here too
    how = {"task": "embed", "embed": params} if isinstance(params, EmbedParams) else {"sampling_params": params}
    job = JobRequest(**items, **how, priority="high" if may_pass else "normal", metadata=metadata, model=model)
    # The stream is followed before the job exists: past FANOUT_MAX_STREAMS no job is made.
    job_id = jobs.new_id()
    follower = st.hub.open(keys.stream(job_id), "0", streams.tenant_id(request))
    try:
        await anyio.to_thread.run_sync(lambda: jobs.submit(st.redis, job, st.settings, job_id=job_id, tenant=tenant,
                                                           online=True))
    except BaseException:
        follower.close()
        raise
    return Online(job_id, follow(st, follower, job_id, request if disconnect else None))


async def follow(st, follower: streams.Follower, job_id: str, request: Request | None) -> AsyncIterator[dict]:
    """The job's stream entries until its terminal status (or a `closed` entry: the key was
    revoked). Ended early (the client went away: `request` says so between reads, or the
    caller closes this), the job is canceled."""
    ended = False
    try:
        while True:
            batch = await follower.next(1.0)
            if request is not None and await request.is_disconnected():
                return
            if follower.closed:
                yield streams.closing(follower)
                return
            if not batch:
                if (await anyio.to_thread.run_sync(submit.ended, st, job_id)
                        and not await follower.read(1)):
                    ended = True
                    return
                continue
            for _, fields in batch:
                entry = events.decode(fields)
                ended = events.is_terminal(entry)
                yield entry
                if ended:
                    return
    finally:
        follower.close()
        if not ended:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(jobs.cancel, st.redis, job_id, st.settings)


def record(entry: dict) -> dict:
    """A final entry's sample record (results.store.sample_record's shape)."""
    return {"text": entry["text"], "finish_reason": entry["finish_reason"], "usage": entry["usage"],
            **{k: entry.get(k) for k in events.OPTIONAL}}


def failure(entry: dict) -> bool:
    """Does this entry end the request's answer (an item's error, a revoked key, a job that
    did not succeed)?"""
    return (entry["type"] in (events.ERROR, streams.CLOSED)
            or (events.is_terminal(entry) and entry["status"] != "succeeded"))


async def first_output(entries: AsyncIterator[dict]) -> list[dict]:
    """The entries up to the first output, so a prompt that cannot run still gets its error
    before a stream starts: Failed (and the job canceled) if one ends the request."""
    first = []
    async for e in entries:
        first.append(e)
        if e["type"] in (events.DELTA, events.FINAL, events.ERROR, streams.CLOSED) or events.is_terminal(e):
            break
    if first and failure(first[-1]):
        await entries.aclose()  # cancels the rest of the job
        raise Failed(first[-1])
    return first


async def replay(first: list[dict], entries: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """The entries first_output read, then the rest of the stream."""
    for e in first:
        yield e
    async for e in entries:
        yield e


async def collect(entries: AsyncIterator[dict], size: int, n: int) -> list[list[dict]]:
    """Every sample's record, by item; Failed when one failed or the job did not succeed."""
    found, end = {}, {}
    try:
        async for e in entries:
            if e["type"] == events.FINAL:
                found[(e["index"], e["sample"])] = record(e)
            elif e["type"] in (events.ERROR, streams.CLOSED):
                raise Failed(e)
            elif events.is_terminal(e):
                end = e
    finally:
        await entries.aclose()  # after an error: cancels the rest of the job
    if end.get("status") != "succeeded":
        raise Failed(end)
    return [[found[(i, j)] for j in range(n)] for i in range(size)]
