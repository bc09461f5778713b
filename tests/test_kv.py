"""KV pools, allocator and radix cache: bookkeeping and the free + cached + in use invariant."""
import os
import random

import pytest
import torch

from worker.engine.kv_manager import KVManager
from worker.engine.host_memory import available_memory
from worker.engine.kv_pool import KVPool, PageAllocator, ReqToTokenPool
from worker.engine.model_runner import cpu_kv_tokens
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


@pytest.mark.parametrize("ps", [1, 4])
def test_decode_slots_follow_pages(ps):
    """Decode steps give each request the slot after its last, a new page's first at a page's
    end, written into its row: on a CPU through the table's numpy view, elsewhere as torch ops
    (run here on a second manager's CPU table); the two give the same slots and tables."""
    host, dev = make(ps), make(ps)
    assert host.host is not None
    dev.host = None  # the device path
    groups = [[req(range(3 + i), f"r{i}") for i in range(3)] for _ in (host, dev)]
    for kvm, reqs in zip((host, dev), groups):
        for r in reqs:
            assert kvm.admit(r)
            kvm.alloc_extend(r, r.extend_todo)
    for _ in range(2 * ps + 1):  # across at least two page ends
        a, b = host.alloc_decode(groups[0]), dev.alloc_decode(groups[1])
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)
        assert torch.equal(host.table, dev.table)
    reqs = groups[0]
    for r in reqs:
        row = host.table[r.req_pool_idx, :r.alloc_len]
        assert (row % ps == torch.arange(r.alloc_len) % ps).all()  # each position's offset in its page
        assert r.alloc_len == 3 + int(r.rid[1:]) + 2 * ps + 1
    flat = torch.cat([host.table[r.req_pool_idx, :r.alloc_len] for r in reqs]).tolist()
    assert len(set(flat)) == len(flat) and 0 not in flat  # no slot twice, none on the scratch page
    for kvm, rs in zip((host, dev), groups):
        for r in rs:
            r.kv_len = r.alloc_len
        kvm.check(rs)


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


def _lru_victims(cache, pages):
    """What eviction must take: repeatedly the least recently used unlocked leaf, found by
    walking the whole tree (the reference the heap is checked against)."""
    order, leaves, evicted = [], {}, set()
    for n in cache._nodes():
        if not n.children and n.lock_ref == 0:
            leaves[id(n)] = n
    gone = 0
    while gone < pages and leaves:
        node = min(leaves.values(), key=lambda n: n.last_access)
        del leaves[id(node)]
        evicted.add(id(node))
        order.append(node.value[::cache.page_size].tolist())
        gone += len(node.key) // cache.page_size
        parent = node.parent
        if (parent.parent is not None and parent.lock_ref == 0
                and all(id(c) in evicted for c in parent.children.values())):
            leaves[id(parent)] = parent
    return order


def test_eviction_is_lru_whatever_the_tree_went_through():
    """Random inserts, matches, locks, unlocks and evictions on a radix cache: every eviction
    takes exactly the pages the least-recently-used walk of the whole tree would, and the
    heap's bookkeeping checks out after each step."""
    from worker.engine.radix_cache import RadixCache

    rng = random.Random(7)
    for ps in (1, 4):
        cache, locked, slot = RadixCache(ps), [], 0
        for step in range(3000):
            op = rng.random()
            if op < 0.5:
                n = rng.randrange(1, 6) * ps
                ids = [rng.randrange(4) for _ in range(n)]
                already, node = cache.insert(ids, torch.arange(slot, slot + n))
                slot += n
                assert cache.match_prefix(ids)[1] is node  # insert's node ends at ids' last token
                if rng.random() < 0.3:
                    cache.lock(node)
                    locked.append(node)
                assert already <= n
            elif op < 0.7 and locked:
                cache.unlock(locked.pop(rng.randrange(len(locked))))
            elif op < 0.8:
                cache.match_prefix([rng.randrange(4) for _ in range(rng.randrange(1, 4) * ps)])
            else:
                k = rng.randrange(1, 4)
                want = [p for pages in _lru_victims(cache, k) for p in pages]
                got = cache.evict(k)
                assert got == [slot // ps for slot in want], step
            cache.check()


def test_eviction_work_grows_with_what_is_evicted_not_the_tree():
    """20,000 cached prefixes: evicting one page at a time looks at about one heap entry each
    (the old walk visited all 20,000 nodes per call)."""
    from worker.engine.radix_cache import RadixCache

    cache = RadixCache(1)
    for i in range(20_000):
        cache.insert([i, 1, 2], torch.arange(3 * i, 3 * i + 3))
    cache.check()
    before = cache.evict_pops
    for _ in range(1000):
        assert len(cache.evict(1)) >= 1
    assert cache.evict_pops - before <= 1000 + 10
    # The oldest prefixes went first, whole leaves (3 pages each).
    assert cache.cached_pages == 3 * 20_000 - 3 * 1000
    assert cache.match_prefix([999, 1, 2, 7])[0] is None and cache.match_prefix([1000, 1, 2, 7])[0] is not None
    cache.check()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_cpu_pool_takes_memory_as_its_pages_are_used():
    """A 1 GiB pool: zeros everywhere, and the process grows by what is written, not 1 GiB."""
    before = _rss()
    kv = KVPool(4, 4096, 16, 8, 512, torch.float32, "cpu")  # 4 x 2 x 65,536 slots x 16 KiB
    assert kv.k[0].shape == (65536, 8, 512) and len(kv.k) == len(kv.v) == 4
    assert all(t.is_contiguous() for t in kv.k + kv.v)
    assert _rss() - before < 64 * 2**20
    assert not any(t[::997].any() for t in kv.k + kv.v)  # reads as zeros (and commits nothing)
    pages = kv.allocator.alloc(64)
    for t in kv.k + kv.v:  # 64 pages x 16 slots x 16 KiB in each of the 8 buffers: 128 MiB written
        t[pages[0] * 16:(pages[-1] + 1) * 16] = 1.0
    grown = _rss() - before
    assert 128 * 2**20 <= grown < 320 * 2**20, grown
    assert kv.k[3][pages[0] * 16].eq(1).all() and kv.v[0][0].eq(0).all()  # layers apart


def test_cpu_pool_sizing():
    GiB, per_token = 2**30, 46080  # SmolLM2-135M's KV bytes a token in fp32
    # Enough memory: every running request's share (1,024 tokens, or a context if shorter).
    assert cpu_kv_tokens(per_token, 8, 8192, 64 * GiB) == (8192, "8 running requests x 1024 tokens")
    assert cpu_kv_tokens(per_token, 8, 512, 64 * GiB)[0] == 8 * 512
    # Bounded by a quarter of what is available, and never below one full context.
    tokens, why = cpu_kv_tokens(per_token, 256, 8192, 20 * GiB)
    assert tokens == 5 * GiB // per_token and why == "a quarter of the 20.0 GiB available"
    assert cpu_kv_tokens(per_token, 256, 8192, GiB // 4)[0] == 8192
    # Memory unknown: 2 GiB at most.
    assert cpu_kv_tokens(per_token, 256, 8192, None)[0] == 2 * GiB // per_token


def test_available_memory_is_read():
    got = available_memory()
    assert got is not None and 0 < got <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
