"""The result channel against a real Redis: store-then-announce, close once, rebuild."""
import json
import pytest
import uuid

from results import events, keys, progress, publisher, reader, store
from results.publisher import Batch


def new_id():
    return "t" + uuid.uuid4().hex


def test_batch_stores_before_it_announces_and_counts(redis):
    job = new_id()
    redis.hset(keys.info(job), mapping={"total": 2, "samples": 2, "ns": "[1, 1]"})
    b = Batch(redis)
    b.status(job, "running")
    b.delta(job, 1, 0, "Hel", [5, 6])
    rec = store.sample_record("Hello", [5, 6, 7], "length", {"prompt_tokens": 3, "cached_tokens": 1,
                                                             "completion_tokens": 3})
    b.final(job, 1, 0, "lo", [7], rec, item_done=True, item_failed=False)
    err = store.sample_record("", [], "error", None, "prompt too long")
    b.final(job, 0, 0, "", [], err, item_done=True, item_failed=True)
    assert redis.xlen(keys.stream(job)) == 0  # nothing until sent, then all at once
    b.send()
    info = progress.read(redis, job)
    assert (info["done"], info["failed"], info["samples_done"], info["completion_tokens"]) == (2, 1, 2, 3)
    assert store.stored(redis, job, [1, 1], 0, 2) == {(0, 0), (1, 0)}
    assert store.stored(redis, job, [1, 1], 1, 2) == {(1, 0)}
    page = store.page(redis, None, job, {"ns": [1, 1]}, 0, 10)
    assert page[1]["samples"] == [{"sample": 0, **rec}] and page[0]["samples"][0]["error"] == "prompt too long"
    entries = [events.decode(f) for _, f in redis.xrange(keys.stream(job))]
    assert [e["type"] for e in entries] == ["status", "delta", "final", "error"]
    assert entries[2]["text"] == "Hello" and entries[2]["delta"] == "lo"


def test_close_writes_one_terminal_entry_and_sets_expiry(redis):
    job = new_id()
    redis.xadd(keys.stream(job), events.status("queued"))
    first = publisher.close(redis, job, "succeeded", 100, done=1, total=1)
    assert first is not None
    assert publisher.close(redis, job, "failed", 100) is None
    entries = [events.decode(f) for _, f in redis.xrange(keys.stream(job))]
    assert entries[-1] == {"type": "status", "status": "succeeded", "done": 1, "total": 1}
    assert len(entries) == 2 and 0 < redis.ttl(keys.stream(job)) <= 100


def test_follow_resumes_and_rebuilder_drops_partials_of_a_new_attempt(redis):
    job = new_id()
    s = keys.stream(job)
    redis.xadd(s, events.attempt(1, "a", 0, 0, 2))
    redis.xadd(s, events.attempt(1, "a", 1, 2, 3))  # a second shard, item 2, on the same worker
    redis.xadd(s, events.delta(0, 0, "ab", [1, 2]))
    mid = redis.xadd(s, events.delta(1, 0, "x", [9])).decode()
    redis.xadd(s, events.delta(2, 0, "q", [4]))
    rec = store.sample_record("abc", [1, 2, 3], "stop", None)
    redis.xadd(s, events.final(0, 0, "c", [3], rec))
    redis.xadd(s, events.attempt(2, "b", 0, 0, 2))  # shard 0 again: item 1 restarts from scratch
    redis.xadd(s, events.delta(1, 0, "y", [8]))
    redis.xadd(s, events.final(1, 0, "z", [7], store.sample_record("yz", [8, 7], "length", None)))
    redis.xadd(s, events.status("succeeded"))
    everything = list(reader.follow(redis, job, timeout=5))
    assert [i for i, _ in reader.follow(redis, job, last_id=mid, timeout=5)] == \
        [i for i, _ in everything][4:]
    rb = reader.Rebuilder()
    for _, e in everything:
        rb.apply(e)
    assert (rb.outputs[(0, 0)].text, rb.outputs[(0, 0)].token_ids) == ("abc", [1, 2, 3])
    assert (rb.outputs[(1, 0)].text, rb.outputs[(1, 0)].token_ids) == ("yz", [8, 7])
    assert rb.outputs[(2, 0)].text == "q"  # another shard's partial sample is kept
    assert rb.status == "succeeded"


def test_samples_per_item_are_kept_as_runs():
    from results.progress import Ns
    ns = Ns.of([1] * 1000 + [3, 3, 1])
    assert ns.runs == [[1, 1000], [3, 2], [1, 1]] and len(ns) == 1003 and ns.samples == 1007
    assert (ns[0], ns[999], ns[1000], ns[1001], ns[1002]) == (1, 1, 3, 3, 1)
    with pytest.raises(IndexError):
        ns[1003]
    assert Ns.decode(ns.encode()) == ns and len(ns.encode()) < 30
    assert list(Ns.decode("[2, 2, 1]")) == [2, 2, 1]  # one number per item, as earlier versions wrote
    assert len(Ns.decode(None)) == 0


def test_shard_bounds_are_kept_as_runs_of_shard_sizes():
    """A million-item job of one `n` is two runs, not 15,626 numbers parsed at every claim
    and status read; every bound, bisect over them and earlier versions' lists agree."""
    from bisect import bisect_left, bisect_right

    from results.progress import Bounds
    from jobs.spec import plan
    for ns in ([1] * 1_000_000, [1, 3, 2, 1, 1, 5, 1, 2] * 50, [8], []):
        plain = plan(ns, 64)
        b = Bounds.of(plain)
        assert list(b) == plain and [b[k] for k in range(len(b))] == plain and b[-1] == plain[-1] == len(ns)
        assert Bounds.decode(b.encode()) == b == Bounds.decode(json.dumps(plain))  # (an earlier version's list)
        for i in (0, 1, 63, 64, 65, len(ns) // 2, len(ns) - 1, len(ns)):
            assert bisect_right(b, i) == bisect_right(plain, i) and bisect_left(b, i) == bisect_left(plain, i)
        with pytest.raises(IndexError):
            b[len(plain)]
    assert Bounds.of(plan([1] * 1_000_000, 64)).encode() == "[[64,15625]]" and len(Bounds().encode()) == 2
