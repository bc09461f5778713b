"""The one owner of KV memory: the pools, their free lists and the radix cache over them
(nano-vllm's block manager). Every page and table row is allocated and freed here; the
radix cache hands the pages it evicts back to this class.

Invariant: free pages + pages cached in the tree + pages private to live requests == total.
A request's private pages cover positions [prefix_len, alloc_len); its first prefix_len
positions are borrowed, locked, from the tree.
"""
from __future__ import annotations

import torch

from .kv_pool import KVPool, ReqToTokenPool
from .models.config import ModelConfig
from .radix_cache import RadixCache
from .req import Req


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVManager:
    def __init__(self, kv: KVPool, req_to_token: ReqToTokenPool, enable_prefix_cache: bool = True):
        self.kv = kv
        self.rtt = req_to_token
        self.cache = RadixCache(kv.page_size, enable_prefix_cache)
        self.alloc = kv.allocator
        self.ps = kv.page_size
        self.table = req_to_token.table
        # On a CPU, the same memory as a numpy array (alloc_decode).
        self.host = self.table.numpy() if self.table.device.type == "cpu" else None

    @classmethod
    def create(cls, model: ModelConfig, kv_tokens: int, page_size: int, max_running: int,
               enable_prefix_cache: bool, dtype: torch.dtype, device: torch.device) -> KVManager:
        """Pools for kv_tokens tokens (rounded up to whole pages, plus the scratch page) and
        max_running requests (plus the scratch row)."""
        num_pages = max(2, kv_tokens // page_size + 1)
        kv = KVPool(model.num_layers, num_pages, page_size, model.num_kv_heads, model.head_dim,
                    dtype, device)
        return cls(kv, ReqToTokenPool(max_running + 1, model.max_context, device),
                   enable_prefix_cache)

    @property
    def num_tokens(self) -> int:
        """Tokens the pool holds, the scratch page aside."""
        return self.alloc.total * self.ps

    @property
    def available_pages(self) -> int:
        return self.alloc.num_free + self.cache.evictable_pages

    def pages_for(self, req: Req, n: int) -> int:
        """New pages needed to extend req by n tokens."""
        return _cdiv(req.alloc_len + n, self.ps) - _cdiv(req.alloc_len, self.ps)

    def admit(self, req: Req) -> bool:
        """Give req a table row and borrow its longest cached prefix. False if no row is free."""
        row = self.rtt.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        slots, node = self.cache.match_prefix(req.tokens(0, req.max_prefix), req.lora)
        n = 0 if slots is None else len(slots)
        if n:
            self.table[row, :n] = slots
        self.cache.lock(node)
        req.last_node, req.prefix_len, req.kv_len, req.alloc_len = node, n, n, n
        return True

    def alloc_extend(self, req: Req, n: int) -> torch.Tensor | None:
        """Slots for positions [alloc_len, alloc_len + n), evicting cached pages if needed."""
        start, end = req.alloc_len, req.alloc_len + n
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.table.device)
        need = self.pages_for(req, n)
        if need > self.alloc.num_free:
            self.evict(need - self.alloc.num_free)
        pages = self.alloc.alloc(need)
        if pages is None:
            return None
        row = self.table[req.req_pool_idx]
        tail = min(n, _cdiv(start, self.ps) * self.ps - start)  # what fits on the last, partly used page
        parts = []
        if tail:
            last = int(row[start - 1]) + 1
            parts.append(torch.arange(last, last + tail))
        if need:  # whole new pages, the last one cut at end
            parts.append((torch.tensor(pages)[:, None] * self.ps + torch.arange(self.ps)).flatten()[:n - tail])
        slots = torch.cat(parts) if len(parts) > 1 else parts[0]
        slots = slots.to(self.table.device)
        row[start:end] = slots
        req.alloc_len = end
        return slots

    def alloc_decode(self, reqs: list[Req]) -> torch.Tensor | None:
        """One slot each for a decode step: the one after its last, or a new page's first."""
        fresh = [r.alloc_len % self.ps == 0 for r in reqs]  # these start a new page
        need = sum(fresh)
        if need > self.alloc.num_free:
            self.evict(need - self.alloc.num_free)
        pages = self.alloc.alloc(need)
        if pages is None:
            return None
        rows, pos = [r.req_pool_idx for r in reqs], [r.alloc_len for r in reqs]
        if self.host is not None:
            # The table's memory read and written as numpy's: the torch ops of the path below
            # took 0.19 ms of a 5 ms batch-1 decode step (SmolLM2 q8, 2-core x86), each
            # dispatch slowed by the forward that evicted the interpreter's caches.
            new = iter(pages)
            slots = [next(new) * self.ps if f else int(self.host[i, p - 1]) + 1
                     for i, p, f in zip(rows, pos, fresh)]
            self.host[rows, pos] = slots  # (all or none)
            slots = torch.tensor(slots, dtype=torch.int64)
        else:
            dev = self.table.device
            rows, pos = torch.tensor(rows, device=dev), torch.tensor(pos, device=dev)
            slots = self.table[rows, (pos - 1).clamp(min=0)] + 1
            if need:
                slots[torch.tensor(fresh, device=dev)] = torch.tensor(pages, device=dev) * self.ps
            self.table[rows, pos] = slots
        for r in reqs:
            r.alloc_len += 1
        return slots

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages cached pages that no request uses. Returns pages freed."""
        pages = self.cache.evict(num_pages)
        self.alloc.free(pages)
        return len(pages)

    def flush_cache(self) -> int:
        """Drop every unreferenced prefix from the radix cache. Returns pages freed."""
        return self.evict(self.cache.evictable_pages)

    def rollback(self, req: Req) -> None:
        """Undo a step's allocation that never ran: free the pages past the one holding
        position kv_len - 1, so alloc_len == kv_len again."""
        start = _cdiv(req.kv_len, self.ps) * self.ps
        self.alloc.free(self._pages(req.req_pool_idx, start, req.alloc_len))
        req.alloc_len = req.kv_len

    def _pages(self, row: int, start: int, end: int) -> list[int]:
        """Pages of the row's positions [start, end), start page-aligned."""
        if end <= start:
            return []
        return (self.table[row, start:end:self.ps] // self.ps).tolist()

    def cache_unfinished(self, req: Req) -> None:
        """Put req's computed prefix in the tree now (after a prefill chunk), so requests
        admitted later share it while req still runs. req keeps it locked."""
        aligned = req.kv_len // self.ps * self.ps
        if not self.cache.enabled or aligned <= req.prefix_len:
            return
        row = req.req_pool_idx
        ids = req.tokens(0, aligned)
        already, node = self.cache.insert(ids, self.table[row, :aligned], req.lora)
        if already > req.prefix_len:  # another request cached some of it since: take the tree's pages
            self.alloc.free(self._pages(row, req.prefix_len, already))
            self.table[row, :aligned] = self.cache.match_prefix(ids, req.lora)[0]
        # (otherwise the row already holds the tree's slots: its borrowed prefix, then its own)
        self.cache.lock(node)
        self.cache.unlock(req.last_node)
        req.last_node, req.prefix_len = node, aligned

    def release(self, req: Req) -> None:
        """Hand req's computed KV to the radix cache, free the rest, unlock, free the row."""
        row = req.req_pool_idx
        if row is None:
            return
        self.cache_unfinished(req)  # now [0, prefix_len) belongs to the tree
        self.alloc.free(self._pages(row, req.prefix_len, req.alloc_len))
        self.cache.unlock(req.last_node)
        self.rtt.free(row)
        req.req_pool_idx, req.last_node = None, None
        req.prefix_len = req.kv_len = req.alloc_len = 0

    def private_pages(self, req: Req) -> int:
        return _cdiv(req.alloc_len, self.ps) - req.prefix_len // self.ps

    def check(self, live: list[Req]) -> None:
        """The invariants: free + cached + in use == total; and a request's positions lie in
        whole pages, position p at offset p % page_size of its page (the attention backends
        gather KV by pages)."""
        self.cache.check()
        for r in live:
            if r.req_pool_idx is not None and r.alloc_len:
                row = self.table[r.req_pool_idx, :r.alloc_len].cpu()
                pos = torch.arange(r.alloc_len)
                assert (row[::self.ps] % self.ps == 0).all() and torch.equal(
                    row, row[pos - pos % self.ps] + pos % self.ps), f"{r.rid}: KV slots not in pages"
        in_use = sum(self.private_pages(r) for r in live if r.req_pool_idx is not None)
        total = self.alloc.num_free + self.cache.cached_pages + in_use
        assert total == self.alloc.total, (
            f"KV leak: free {self.alloc.num_free} + cached {self.cache.cached_pages} + "
            f"in use {in_use} != total {self.alloc.total}")
