"""Radix prefix cache over token ids, at page granularity.

Each edge holds a run of tokens (a multiple of page_size) and the KV slots that hold
them. A request borrows a matched prefix by locking the path to its last node; unlocked
leaves are evicted least-recently-used first, their pages handed back to the caller
(KVManager, which frees them: the tree never touches the allocator).
Pages owned by the tree are "cached"; locked ones are "protected", the rest "evictable".
"""
from __future__ import annotations

import heapq
import itertools

import torch


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent=None, key=(), value=None):
        self.children: dict[tuple, TreeNode] = {}
        self.parent = parent
        self.key: tuple[int, ...] = tuple(key)
        self.value: torch.Tensor | None = value  # slots, len == len(key)
        self.lock_ref = 0
        self.last_access = 0


class RadixCache:
    def __init__(self, page_size: int, enabled: bool = True):
        self.page_size = page_size
        self.enabled = enabled
        self.root = TreeNode()
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.cached_pages = 0
        self.protected_pages = 0

    @property
    def evictable_pages(self) -> int:
        return self.cached_pages - self.protected_pages

    def _child_key(self, ids, i):
        return tuple(ids[i:i + self.page_size])

    def _prefix_len(self, key, ids, start) -> int:
        """Common length of key and ids[start:], in whole pages."""
        n = 0
        limit = min(len(key), len(ids) - start)
        while n < limit and key[n] == ids[start + n]:
            n += 1
        return n - n % self.page_size

    def match_prefix(self, ids: list[int]) -> tuple[torch.Tensor | None, TreeNode]:
        """Longest cached page-aligned prefix of ids: (slots or None, last matched node)."""
        node, i, parts = self.root, 0, []
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
        return (torch.cat(parts) if parts else None), node

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Split node's edge after n tokens; return the new upper node."""
        upper = TreeNode(node.parent, node.key[:n], node.value[:n])
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.parent.children[self._child_key(node.key, 0)] = upper
        node.key, node.value, node.parent = node.key[n:], node.value[n:], upper
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    def insert(self, ids: list[int], slots: torch.Tensor) -> int:
        """Insert a page-aligned prefix. Returns how many leading tokens were already cached:
        the caller owns (and must free) its own slots for those tokens unless they are the
        very slots it borrowed from the tree."""
        assert len(ids) % self.page_size == 0 and len(ids) == len(slots)
        if not self.enabled:
            return 0
        node, i = self.root, 0
        now = next(self._clock)
        while i < len(ids):
            child = node.children.get(self._child_key(ids, i))
            if child is None:
                new = TreeNode(node, ids[i:], slots[i:].clone())
                new.last_access = now
                node.children[self._child_key(ids, i)] = new
                self.cached_pages += (len(ids) - i) // self.page_size
                return i
            n = self._prefix_len(child.key, ids, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, i = child, i + n
        return i

    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.protected_pages += len(node.key) // self.page_size
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            assert node.lock_ref >= 0
            if node.lock_ref == 0:
                self.protected_pages -= len(node.key) // self.page_size
            node = node.parent

    def evict(self, num_pages: int) -> list[int]:
        """Remove unlocked leaves, LRU first, until at least num_pages pages are out of the
        tree (or none is left to remove). Returns those pages, for the caller to free."""
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed: list[int] = []
        while len(freed) < num_pages and leaves:
            _, _, node = heapq.heappop(leaves)
            pages = (node.value[::self.page_size] // self.page_size).tolist()
            freed += pages
            self.cached_pages -= len(pages)
            parent = node.parent
            del parent.children[self._child_key(node.key, 0)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root:
                yield node

    def check(self) -> None:
        """Tree bookkeeping matches the nodes (for tests and idle-time integrity checks)."""
        pages = sum(len(n.key) // self.page_size for n in self._nodes())
        locked = sum(len(n.key) // self.page_size for n in self._nodes() if n.lock_ref > 0)
        assert pages == self.cached_pages, (pages, self.cached_pages)
        assert locked == self.protected_pages, (locked, self.protected_pages)
