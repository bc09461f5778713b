"""KV memory: the request-to-token table, the paged token-to-KV pool and its allocator.
KVManager (kv_manager.py) creates them and is the only one that allocates or frees.

A slot is one token's K and V in every layer. Slots come in pages of `page_size`;
slot = page * page_size + offset. Page 0 is reserved as a scratch page (padded rows
of a CUDA graph write there), so `num_pages - 1` pages are usable.

On a CPU the pool is one anonymous mapping: its pages read as zeros and take memory only
once written, and the allocator hands out low pages first and reuses freed pages first, so
the process holds the KV its requests (and the prefix cache) have used at most, not the
pool's size.
"""
from __future__ import annotations

import mmap

import torch


class PageAllocator:
    """Free list of pages. Invariant (KVManager.check): free + cached + in use == total."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("KV pool too small: need at least 2 pages")
        self.page_size = page_size
        self.num_pages = num_pages
        self.total = num_pages - 1  # page 0 is scratch
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        return out

    def free(self, pages) -> None:
        self._free.extend(pages)


class KVPool:
    """Per-layer K and V buffers of shape [num_pages * page_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device):
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        shape = (self.num_slots, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            size = 2 * num_layers * self.num_slots * num_kv_heads * head_dim * _itemsize(dtype)
            # The tensor keeps the mapping alive; zero pages until written (the module doc).
            mapping = mmap.mmap(-1, size)
            if hasattr(mmap, "MADV_HUGEPAGE"):  # 2 MiB pages where allowed: fewer first-use faults
                mapping.madvise(mmap.MADV_HUGEPAGE)
            buffers = torch.frombuffer(mapping, dtype=torch.uint8).view(dtype)
            layers = list(buffers.view(2 * num_layers, *shape))
            self.k, self.v = layers[:num_layers], layers[num_layers:]
        else:
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = PageAllocator(num_pages, page_size)

    @staticmethod
    def bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * _itemsize(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class ReqToTokenPool:
    """Row r maps request r's token positions to KV slots (the `req_to_token` table).

    One row, `scratch_row`, is never handed out and stays all zeros: padded rows of a CUDA
    graph batch point there, so they read and write only slot 0 of the scratch page."""

    def __init__(self, max_reqs: int, max_context: int, device):
        self.table = torch.zeros((max_reqs, max_context), dtype=torch.int64, device=device)
        self._free = list(range(max_reqs - 1, -1, -1))
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.scratch_row = self._free.pop()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, idx: int) -> None:
        self._free.append(idx)
