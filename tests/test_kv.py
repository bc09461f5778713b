"""KV pools, allocator and radix cache: bookkeeping and the free + cached + in use invariant."""
import random

import pytest
import torch

from worker.engine.kv_manager import KVManager
from worker.engine.kv_pool import KVPool, PageAllocator, ReqToTokenPool
from worker.engine.req import Req
from worker.engine.sampling_params import SamplingParams


def make(page_size, num_pages=64, max_reqs=8, enabled=True):
    kv = KVPool(1, num_pages, page_size, 1, 4, torch.float32, "cpu")
    rtt = ReqToTokenPool(max_reqs + 1, 512, "cpu")  # + the scratch row
    return KVManager(kv, rtt, enabled)


def req(ids, rid="r"):
    return Req(rid=rid, input_ids=list(ids), params=SamplingParams(), seed=0)


def test_allocator_counts_and_scratch_page():
    a = PageAllocator(5, 4)
    assert a.total == 4 and a.num_free == 4
    got = a.alloc(3)
    assert 0 not in got and len(set(got)) == 3
    assert a.alloc(2) is None
    a.free(got)
    assert a.num_free == 4


@pytest.mark.parametrize("ps", [1, 16])
def test_slots_follow_pages(ps):
    kvm = make(ps)
    r = req(range(40))
    assert kvm.admit(r)
    s1 = kvm.alloc_extend(r, 21)
    s2 = kvm.alloc_extend(r, 5)
    slots = torch.cat([s1, s2])
    assert len(set(slots.tolist())) == 26
    # Positions on one page are consecutive slots of that page.
    for p in range(26):
        assert slots[p] // ps == slots[p - p % ps] // ps
        assert slots[p] % ps == p % ps
    assert (kvm.table[r.req_pool_idx, :26] == slots).all()
    r.kv_len = 26
    kvm.check([r])
    kvm.release(r)
    kvm.check([])


@pytest.mark.parametrize("ps", [1, 16])
def test_prefix_shared_then_evicted(ps):
    kvm = make(ps, num_pages=12 if ps == 16 else 160)
    a = req(range(100), "a")
    kvm.admit(a)
    kvm.alloc_extend(a, 100)
    a.kv_len = 100
    kvm.release(a)
    cached = kvm.cache.cached_pages
    assert cached == 100 // ps
    kvm.check([])
    # Same prompt: everything but the last token (page-aligned) comes from the cache.
    b = req(range(100), "b")
    kvm.admit(b)
    assert b.prefix_len == (99 // ps) * ps
    assert kvm.cache.protected_pages == b.prefix_len // ps
    kvm.alloc_extend(b, b.extend_todo)
    b.kv_len = 100
    kvm.check([b])
    kvm.release(b)
    kvm.check([])
    assert kvm.cache.cached_pages == cached  # no duplicate pages kept
    # A different prompt that needs the whole pool evicts the unlocked cache.
    c = req([7] * (kvm.alloc.total * ps), "c")
    kvm.admit(c)
    assert c.prefix_len == 0
    assert kvm.alloc_extend(c, kvm.alloc.total * ps) is not None
    assert kvm.cache.cached_pages == 0
    c.kv_len = c.alloc_len
    kvm.check([c])


def test_locked_prefix_is_not_evicted():
    kvm = make(1, num_pages=41)
    a = req(range(30), "a")
    kvm.admit(a); kvm.alloc_extend(a, 30); a.kv_len = 30
    kvm.release(a)
    b = req(list(range(30)) + [99], "b")
    kvm.admit(b)
    assert b.prefix_len == 30
    assert kvm.evict(100) == 0  # all of it is locked by b
    other = req([5] * 20, "o")
    kvm.admit(other)
    assert kvm.alloc_extend(other, 20) is None  # only 10 free, nothing evictable
    kvm.check([b, other])


def test_duplicate_insert_frees_the_copy():
    kvm = make(1, num_pages=200)
    a, b = req(range(50), "a"), req(range(50), "b")
    for r in (a, b):  # both admitted before either is cached: both compute everything
        kvm.admit(r); kvm.alloc_extend(r, 50); r.kv_len = 50
    kvm.release(a)
    kvm.release(b)
    kvm.check([])
    assert kvm.cache.cached_pages == 50
    assert kvm.alloc.num_free == kvm.alloc.total - 50


def test_random_workload_keeps_invariant():
    rng = random.Random(0)
    kvm = make(4, num_pages=80, max_reqs=6)
    live = []
    base = [rng.randrange(5) for _ in range(64)]
    for step in range(300):
        if live and rng.random() < 0.3:
            r = live.pop(rng.randrange(len(live)))
            r.kv_len = r.alloc_len
            kvm.release(r)
        elif len(live) < 6:
            ids = base[:rng.randrange(1, 64)] + [rng.randrange(5) for _ in range(rng.randrange(1, 20))]
            r = req(ids, f"r{step}")
            if kvm.admit(r):
                if kvm.alloc_extend(r, r.extend_todo) is None:
                    kvm.release(r)
                else:
                    live.append(r)
        kvm.check(live)
    for r in live:
        r.kv_len = r.alloc_len
        kvm.release(r)
    kvm.check([])
    assert kvm.alloc.num_free + kvm.cache.cached_pages == kvm.alloc.total
