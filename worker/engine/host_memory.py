"""The CPU path's host memory: what is free at start (available_memory, which sizes the
default KV pool), and the allocator setting: freed activation buffers stay in the heap.

A forward allocates its activations afresh in every layer ([tokens, intermediate] for the MLP:
12 MB at a 2,048-token chunk of SmolLM2). glibc's malloc serves such blocks with mmap and
unmaps them when freed, so each one is page-faulted in again, zeroed by the kernel, on its
next use: on SmolLM2-135M, a 13,500-token prefill on 2 cores spent ~17% of its time there
(the elementwise ops ran at ~2 GB/s). With a fixed mmap threshold of 32 MiB (glibc's maximum)
and no trimming, freed blocks are reused from the heap: the same run took 0.83x the time.
The price: the heap keeps its peak size (the activations of the largest step) instead of
returning it between steps. Blocks over 32 MiB (the KV pool) are still mmapped.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("fanout.engine")

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit
TOP_PAD = 64 << 20  # grow the heap in steps of this much, not a page at a time
_done = False


def keep_freed_blocks() -> bool:
    """Set glibc's malloc as the module doc says, once per process. False (and a debug
    line) where the C library is not glibc: nothing changes there."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this C library: the allocator is left as it is")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, TOP_PAD)))
    _done = ok
    return ok


def available_memory() -> int | None:
    """Bytes this process may still take: the kernel's MemAvailable, or less where a cgroup
    (a container's memory limit) allows less; None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                found.append(max(0, int(limit) - int(f.read())))
    except (OSError, ValueError):
        pass
    return min(found, default=None)
