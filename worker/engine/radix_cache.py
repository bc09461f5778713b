"""Radix prefix cache over token ids, at page granularity.

Each edge holds a run of tokens (a multiple of page_size) and the KV slots that hold
them. A request borrows a matched prefix by locking the path to its last node; unlocked
leaves are evicted least-recently-used first, their pages handed back to the caller
(KVManager, which frees them: the tree never touches the allocator).
Pages owned by the tree are "cached"; locked ones are "protected", the rest "evictable".

One tree per namespace (`ns`, a root each): KV computed under one LoRA adapter (its slot,
lora.py; 0 the base model) is never a prefix for another's requests, whose projections
differ. Eviction is over every tree.

Eviction does not walk the tree: a heap holds the evictable leaves (unlocked, childless) by
last access, kept as the tree changes. An entry is pushed whenever a node may have become an
evictable leaf or its access time moved while it is one (insert, a match, unlock, the
eviction of its last child); entries a later push or a lock made stale are skipped when
popped (a node's `heap_seq` names its one live entry). So evicting k leaves costs O((k +
stale entries) log n), and the heap is rebuilt from the tree once it holds over twice as
many entries as there are nodes, which keeps the stale ones amortized O(1) per change.
"""
from __future__ import annotations

import heapq
import itertools

import torch


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "heap_seq")

    def __init__(self, parent=None, key=(), value=None):
        self.children: dict[tuple, TreeNode] = {}
        self.parent = parent
        self.key: tuple[int, ...] = tuple(key)
        self.value: torch.Tensor | None = value  # slots, len == len(key)
        self.lock_ref = 0
        self.last_access = 0
        self.heap_seq = 0  # the seq of its live entry in RadixCache._heap (0: none)


class RadixCache:
    def __init__(self, page_size: int, enabled: bool = True):
        self.page_size = page_size
        self.enabled = enabled
        self.roots: dict[int, TreeNode] = {}  # ns -> its tree's root (root(ns))
        self._clock = itertools.count(1)
        self.cached_pages = 0
        self.protected_pages = 0
        self._heap: list[tuple[int, int, TreeNode]] = []  # (last_access, seq, node)
        self._seq = itertools.count(1)
        self.nodes = 0  # in the tree, root excluded
        self.evict_pops = 0  # heap entries looked at by evict, over the cache's life (tests count them)

    def root(self, ns: int = 0) -> TreeNode:
        node = self.roots.get(ns)
        if node is None:
            node = self.roots[ns] = TreeNode()
            node.lock_ref = 1  # never evicted
        return node

    def _push(self, node: TreeNode) -> None:
        """Give node a live heap entry if it is an evictable leaf now."""
        if node.lock_ref == 0 and not node.children and node.parent is not None:
            node.heap_seq = next(self._seq)
            heapq.heappush(self._heap, (node.last_access, node.heap_seq, node))
            if len(self._heap) > 2 * self.nodes + 64:
                self._rebuild()

    def _rebuild(self) -> None:
        self._heap = []
        for n in self._nodes():
            n.heap_seq = 0
            if n.lock_ref == 0 and not n.children:
                n.heap_seq = next(self._seq)
                self._heap.append((n.last_access, n.heap_seq, n))
        heapq.heapify(self._heap)

    @property
    def evictable_pages(self) -> int:
        return self.cached_pages - self.protected_pages

    def _child_key(self, ids, i):
        return tuple(ids[i:i + self.page_size])

    def _prefix_len(self, key, ids, start) -> int:
        """Common length of key and ids[start:], in whole pages."""
        limit = min(len(key), len(ids) - start)
        if key[:limit] == tuple(ids[start:start + limit]):  # the usual case, compared in C
            n = limit
        else:
            n = 0
            while key[n] == ids[start + n]:  # stops before limit: they differ there
                n += 1
        return n - n % self.page_size

    def match_prefix(self, ids: list[int], ns: int = 0) -> tuple[torch.Tensor | None, TreeNode]:
        """Longest cached page-aligned prefix of ids in namespace ns: (slots or None, last
        matched node)."""
        node, i, parts = self.root(ns), 0, []
        if not self.enabled:
            return None, node
        now = next(self._clock)
        while len(ids) - i >= self.page_size:
            child = node.children.get(self._child_key(ids, i))
            if child is None:
                break
            n = self._prefix_len(child.key, ids, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.value)
            node, i = child, i + n
        self._push(node)  # its access moved (a leaf only: inner nodes are not in the heap)
        return (torch.cat(parts) if parts else None), node

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Split node's edge after n tokens; return the new upper node."""
        upper = TreeNode(node.parent, node.key[:n], node.value[:n])
        self.nodes += 1
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.parent.children[self._child_key(node.key, 0)] = upper
        node.key, node.value, node.parent = node.key[n:], node.value[n:], upper
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    def insert(self, ids: list[int], slots: torch.Tensor, ns: int = 0) -> tuple[int, TreeNode]:
        """Insert a page-aligned prefix in namespace ns. Returns how many leading tokens were already cached
        (the caller owns, and must free, its own slots for those tokens unless they are the
        very slots it borrowed from the tree) and the node that ends at ids' last token (the
        one match_prefix(ids) would return)."""
        assert len(ids) % self.page_size == 0 and len(ids) == len(slots)
        if not self.enabled:
            return 0, self.root(ns)
        node, i = self.root(ns), 0
        now = next(self._clock)
        while i < len(ids):
            child = node.children.get(self._child_key(ids, i))
            if child is None:
                new = TreeNode(node, ids[i:], slots[i:].clone())
                new.last_access = now
                node.children[self._child_key(ids, i)] = new
                self.nodes += 1
                self.cached_pages += (len(ids) - i) // self.page_size
                self._push(new)  # its parent, a leaf no more, keeps a stale entry
                return i, new
            n = self._prefix_len(child.key, ids, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, i = child, i + n
        self._push(node)
        return i, node

    def lock(self, node: TreeNode) -> None:
        while node.parent is not None:  # up to its root
            if node.lock_ref == 0:
                self.protected_pages += len(node.key) // self.page_size
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node.parent is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0
            if node.lock_ref == 0:
                self.protected_pages -= len(node.key) // self.page_size
                self._push(node)
            node = node.parent

    def evict(self, num_pages: int) -> list[int]:
        """Remove unlocked leaves, LRU first, until at least num_pages pages are out of the
        tree (or none is left to remove). Returns those pages, for the caller to free."""
        freed: list[int] = []
        while len(freed) < num_pages and self._heap:  # (a push may rebuild the heap)
            _, seq, node = heapq.heappop(self._heap)
            self.evict_pops += 1
            if seq != node.heap_seq or node.lock_ref or node.children or node.parent is None:
                continue  # stale: pushed again since, locked, grown a child, or gone
            pages = (node.value[::self.page_size] // self.page_size).tolist()
            freed += pages
            self.cached_pages -= len(pages)
            self.nodes -= 1
            parent = node.parent
            del parent.children[self._child_key(node.key, 0)]
            node.parent, node.heap_seq = None, 0
            self._push(parent)
        return freed

    def _nodes(self):
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:
                yield node

    def check(self) -> None:
        """Tree bookkeeping matches the nodes (for tests and idle-time integrity checks)."""
        pages = sum(len(n.key) // self.page_size for n in self._nodes())
        locked = sum(len(n.key) // self.page_size for n in self._nodes() if n.lock_ref > 0)
        assert pages == self.cached_pages, (pages, self.cached_pages)
        assert locked == self.protected_pages, (locked, self.protected_pages)
        nodes = list(self._nodes())
        assert len(nodes) == self.nodes, (len(nodes), self.nodes)
        # Every evictable leaf has its live entry, at its current access time.
        live = {seq: access for access, seq, _ in self._heap}
        for n in nodes:
            if n.lock_ref == 0 and not n.children:
                assert live.get(n.heap_seq) == n.last_access, "an evictable leaf is missing from the heap"
