"""The tensors of one forward pass, built by ScheduleBatch (scheduler.py) for the model runner.

Req -> ScheduleBatch -> ForwardBatch: the runner and the attention backends see only this.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch


class ForwardMode(IntEnum):
    EXTEND = 1  # new tokens on top of a (maybe empty) cached prefix; decode rows may ride along
    DECODE = 2  # exactly one new token per request


@dataclass(slots=True)
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, the new tokens of all requests, concatenated
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot each new token writes to
    req_pool_indices: torch.Tensor  # [B] int64, row of each request in req_to_token
    seq_lens: torch.Tensor  # [B] int64, prefix + new tokens
    prefix_lens: torch.Tensor  # [B] int64, tokens whose KV is already in the pool
    extend_lens: torch.Tensor  # [B] int64, new tokens per request (1 in decode)
    extend_start_loc: torch.Tensor  # [B] int64, offset of each request's first new token in [T]
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    req_to_token: torch.Tensor  # [max_reqs, max_context] int64
    kv: Any  # KVPool
    attn: Any = None  # the attention backend, with metadata prepared for this batch
    # Rows of [T] whose logits the runner computes: the last new token of each request,
    # or every new token for requests that asked for prompt logits.
    logits_idx: torch.Tensor | None = None
    # One-token rows whose cached prefixes share radix-tree nodes (n > 1 samples, common
    # system prompts): backends may attend for the whole group at once over the union of
    # their KV, each row masked to its own. None when no such group is worth it.
    shared: list | None = None  # list[SharedGroup]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(slots=True)
class SharedGroup:
    rows: list[int]  # batch indices
    slots: torch.Tensor  # [K] the union of the rows' KV slots, each once
    mask: torch.Tensor  # [r, K] True where the row's own sequence holds that slot


@dataclass(slots=True)
class ScheduleBatch:
    """The requests of one step and how many new tokens each runs (slots already allocated)."""
    reqs: list  # list[Req]
    extend_lens: list[int]
    out_cache_loc: list  # slot tensors, concatenated in request order (decodes in one)

    def needs_logits(self, i: int) -> bool:
        r = self.reqs[i]
        return r.kv_len + self.extend_lens[i] == r.seq_len

    def to_forward_batch(self, kv, req_to_token: torch.Tensor, device) -> ForwardBatch:
        ids, pos, logit_rows = [], [], []
        prefix, seq, starts = [], [], []
        t = 0
        for i, (r, n) in enumerate(zip(self.reqs, self.extend_lens)):
            ids.extend(r.tokens(r.kv_len, r.kv_len + n))
            pos.extend(range(r.kv_len, r.kv_len + n))
            prefix.append(r.kv_len)
            seq.append(r.kv_len + n)
            starts.append(t)
            if r.return_prompt_logits:
                logit_rows.extend(range(t, t + n))
            elif self.needs_logits(i):
                logit_rows.append(t + n - 1)
            t += n
        mode = ForwardMode.DECODE if all(n == 1 for n in self.extend_lens) else ForwardMode.EXTEND

        def tensor(x):
            return torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True)

        return ForwardBatch(
            mode=mode, input_ids=tensor(ids), positions=tensor(pos),
            out_cache_loc=torch.cat(self.out_cache_loc).to(device),
            req_pool_indices=tensor([r.req_pool_idx for r in self.reqs]),
            seq_lens=tensor(seq), prefix_lens=tensor(prefix), extend_lens=tensor(self.extend_lens),
            extend_start_loc=tensor(starts), seq_lens_cpu=seq, prefix_lens_cpu=prefix,
            extend_lens_cpu=list(self.extend_lens), req_to_token=req_to_token, kv=kv,
            logits_idx=tensor(logit_rows), shared=self._shared_groups(req_to_token, seq))

    def _shared_groups(self, req_to_token: torch.Tensor, seq: list[int]) -> list:
        """Group one-token rows by the first radix node of their borrowed prefix; keep the
        groups whose union of slots is at most 3/4 of what the rows read one by one."""
        by_root: dict[int, list[int]] = {}
        for i, (r, n) in enumerate(zip(self.reqs, self.extend_lens)):
            if n == 1 and r.prefix_len and r.last_node is not None:
                root_child = r.last_node
                while root_child.parent is not None and root_child.parent.parent is not None:
                    root_child = root_child.parent
                by_root.setdefault(id(root_child), []).append(i)
        out = []
        for rows in by_root.values():
            if len(rows) < 2:
                continue
            nodes: dict[int, tuple[int, int]] = {}  # node id -> (offset, length) in the union
            parts, k = [], 0
            paths = []
            for i in rows:
                path = []
                node = self.reqs[i].last_node
                while node.parent is not None:  # up to (not including) the root
                    if id(node) not in nodes:
                        nodes[id(node)] = (k, len(node.key))
                        parts.append(node.value)
                        k += len(node.key)
                    path.append(nodes[id(node)])
                    node = node.parent
                paths.append(path)
            own = []
            for i in rows:
                r = self.reqs[i]
                own.append((k, seq[i] - r.prefix_len))
                parts.append(req_to_token[r.req_pool_idx, r.prefix_len:seq[i]])
                k += seq[i] - r.prefix_len
            if k > 0.75 * sum(seq[i] for i in rows):
                continue
            mask = torch.zeros(len(rows), k, dtype=torch.bool)
            for j, (path, (o, n)) in enumerate(zip(paths, own)):
                for po, pn in path:
                    mask[j, po:po + pn] = True
                mask[j, o:o + n] = True
            dev = req_to_token.device
            out.append(SharedGroup(rows, torch.cat(parts).to(dev), mask.to(dev)))
        return out or None
