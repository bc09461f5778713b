"""A job's items laid out by shard (the shard rule: jobs.spec.plan): one JSON array of
item entries per shard, kept in the job's Redis list (jobs/shards.py) or, for a large
job, in the blob store, one object per shard (keys.items_blob), written at submit
(store_items) or as a file's lines are read (Builder). A worker reads its shard's back
(worker/attempts.py)."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

from results import blobs, keys
from results.progress import Bounds, Ns

from .settings import Settings
from .spec import Cut, JobSpec, plan


@dataclass(slots=True)
class Layout:
    """A job cut into shards: shard k holds items [bounds[k], bounds[k + 1]), its entries one
    JSON array in chunks[k] (None: they are in the blob store already, Builder); `shared`:
    the sampling parameters all items share, or None."""
    bounds: Bounds
    chunks: list[str] | None
    shared: str | None

    @property
    def total(self) -> int:
        return len(self.bounds) - 1

    @property
    def size(self) -> int:
        return sum(len(c) for c in self.chunks)


def layout(spec: JobSpec, settings: Settings) -> Layout:
    entries, shared = spec.layout()
    bounds = plan([p.n for p in spec.sampling_params], settings.shard_samples)
    # One array per shard: a shard reads one value, and a 100,000-item job is a few
    # thousand values to send, not 100,000.
    return Layout(Bounds.of(bounds), ["[" + ",".join(entries[bounds[k]:bounds[k + 1]]) + "]"
                                      for k in range(len(bounds) - 1)], shared)


STATE_EVERY = 2.0  # seconds between two states a Builder hands to on_shards
STORE_THREADS = 8  # objects written at once: a round trip (or an fsync) each, not one after another


def _put(store, key: str, chunk: str) -> None:
    with store.writer(key) as w:
        w.write(chunk.encode())


def store_items(store, job_id: str, lay: Layout) -> None:
    """Before the submit's transaction: each shard's items to the blob store."""
    with ThreadPoolExecutor(STORE_THREADS) as pool:
        for _ in pool.map(lambda k: _put(store, keys.items_blob(job_id, k), lay.chunks[k]), range(lay.total)):
            pass  # the first failure raises here


class Builder:
    """A job's shards laid out as its items come (a file read line by line), each written to
    the blob store once full: the process holds a few shards' entries, not the job's. Every
    DUE_EVERY shards, before writing them, they are marked due (keys.blobs_due) ORPHAN
    seconds on: the job, once created, keeps them (the sweep finds its keys); a process
    that died midway leaves nothing behind."""
    DUE_EVERY = 256

    def __init__(self, redis, store, job_id: str, samples: int, state_every: float = STATE_EVERY):
        self.redis, self.store, self.job_id = redis, store, job_id
        self.cut, self.bounds, self.entries, self.count = Cut(samples), Bounds(), [], 0
        self.ns = Ns()  # the items' samples, as they come
        self.pool, self.pending = ThreadPoolExecutor(STORE_THREADS), []
        # on_shards(state): called as a shard starts (at most every state_every seconds), once
        # every shard before it is written: where a reader that died resumes (api/validation.py).
        self.on_shards, self.state_every = None, state_every  # set by the reader (dataset.plan)
        self.next_state = time.monotonic() + state_every

    def state(self) -> dict:
        """The items laid out so far, all in written shards (only between shards)."""
        assert not self.entries, "a shard is half laid out"
        return {"bounds": self.bounds.encode(), "ns": self.ns.encode(), "count": self.count}

    def restore(self, state: dict) -> None:
        """Carry on after `state` (state()): the next item starts the next shard."""
        self.bounds, self.ns, self.count = Bounds.decode(state["bounds"]), Ns.decode(state["ns"]), state["count"]

    def custom_ids(self) -> Iterator[str]:
        """The custom ids of the items in the shards written so far (read back from the store)."""
        for k in range(self.bounds.shards):
            for entry in json.loads(b"".join(self.store.get(keys.items_blob(self.job_id, k)))):
                if "c" in entry:
                    yield entry["c"]

    def add(self, entry: str, n: int, custom_id: str | None = None) -> None:
        """The next item: its entry (JobSpec.layout's form), its samples and its custom id,
        which its entry carries ("c"): a dataset's ids stay in the store with its items, not
        in Redis or in this process."""
        if self.cut.add(n):
            self._flush()
            self.bounds.add(self.count - self.bounds.items)
            if self.on_shards is not None and time.monotonic() >= self.next_state:
                for f in self.pending:  # every shard before this one written
                    f.result()
                self.pending = []
                self.on_shards(self.state())
                self.next_state = time.monotonic() + self.state_every
        if custom_id is not None:
            entry = entry[:-1] + ',"c":' + json.dumps(custom_id) + "}"
        self.entries.append(entry)
        self.ns.append(n)
        self.count += 1

    def _flush(self) -> None:
        k = self.bounds.shards  # the shard being written
        if k % self.DUE_EVERY == 0:
            self.redis.zadd(keys.blobs_due(), {keys.due_job(self.job_id, k, k + self.DUE_EVERY):
                                               time.time() + blobs.ORPHAN})
        key = keys.items_blob(self.job_id, k)
        self.pending.append(self.pool.submit(_put, self.store, key, "[" + ",".join(self.entries) + "]"))
        self.entries = []
        if len(self.pending) >= 2 * STORE_THREADS:  # bounded: wait for the oldest write
            self.pending.pop(0).result()

    def finish(self) -> Layout:
        """Write the last shard, wait for every write (StoreError if one failed)."""
        try:
            if self.entries:
                self._flush()
            for f in self.pending:
                f.result()
        finally:
            self.pool.shutdown(cancel_futures=True)
        self.bounds.add(self.count - self.bounds.items)
        return Layout(self.bounds, None, None)

    def abandon(self) -> None:
        """Given up (an invalid line): no more writes, and those made swept at once."""
        self.pool.shutdown(cancel_futures=True)
        self.redis.zadd(keys.blobs_due(), {keys.due_job(self.job_id, 0, self.bounds.shards + 1): 0})
