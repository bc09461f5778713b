"""The tensors of one forward pass, built by ScheduleBatch (scheduler.py) for the model runner.

Req -> ScheduleBatch -> ForwardBatch: the runner and the attention backends see only this.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

import torch

from .kv_pool import KVPool
from .lora import LoraBatch, Loras
from .req import Req

if TYPE_CHECKING:
    from .attention.base import AttentionBackend, AttentionMetadata
    from .images import Image


class ForwardMode(IntEnum):
    EXTEND = 1  # new tokens on top of a (maybe empty) cached prefix; decode rows may ride along
    DECODE = 2  # exactly one new token per request


@dataclass(slots=True)
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, the new tokens of all requests, concatenated
    # [T] int64; [3, T] (M-RoPE's t, h, w rows) when an M-RoPE image's tokens run (req.py)
    positions: torch.Tensor
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
    kv: KVPool
    attn: AttentionBackend | None = None  # set by the model runner before the forward
    attn_meta: AttentionMetadata | None = None  # attn's metadata for this batch
    # Rows of [T] whose logits the runner computes: the last new token of each request,
    # or every new token for requests that asked for prompt logits.
    logits_idx: torch.Tensor | None = None
    # One-token rows whose cached prefixes start with the same radix-tree nodes (n > 1
    # samples, a common system prompt): backends may attend to that common prefix once for
    # the whole group. None when no group is worth it.
    shared: list[SharedGroup] | None = None
    # Images whose tokens run in this batch (prefill only): each distinct image once.
    images: ImageBatch | None = None
    # The rows of each LoRA adapter's requests (lora.py); None when every request is the base's.
    lora: LoraBatch | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(slots=True)
class ImageBatch:
    images: list[Image]  # the distinct images (by pad id), in order of first use
    rows: torch.Tensor  # [M] int64, rows of [T] that are image tokens
    features: torch.Tensor  # [M] int64, row of the images' concatenated features for each
    cut: set[int]  # pad ids of the images whose tokens go on past this batch (the next chunk's)

    @classmethod
    def build(cls, reqs: list[Req], extend_lens: list[int], device) -> ImageBatch | None:
        """The image tokens among each request's new positions [kv_len, kv_len + n): a chunk
        may start or end inside an image, so features are taken by offset into it."""
        offsets: dict[int, int] = {}  # pad id -> its first feature row
        images, rows, feats, cut = [], [], [], set()
        t = total = 0
        for r, n in zip(reqs, extend_lens):
            lo, hi = r.kv_len, r.kv_len + n
            for span in r.images:
                a, b = max(span.start, lo), min(span.start + span.length, hi)
                if a >= b:
                    continue
                if span.image.pad not in offsets:
                    offsets[span.image.pad] = total
                    images.append(span.image)
                    total += span.length
                rows.extend(range(t + a - lo, t + b - lo))
                base = offsets[span.image.pad] - span.start
                feats.extend(range(base + a, base + b))
                if b < span.start + span.length:
                    cut.add(span.image.pad)
            t += n
        if not rows:
            return None

        def tensor(x):
            return torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True)

        return cls(images, tensor(rows), tensor(feats), cut)


@dataclass(slots=True)
class SharedGroup:
    rows: list[int]  # batch indices
    prefix_len: int  # the rows' first prefix_len KV slots are the same slots


@dataclass(slots=True)
class ScheduleBatch:
    """The requests of one step and how many new tokens each runs (slots already allocated)."""
    SHARED_MIN = 64  # a shorter common prefix is not worth a separate attention pass
    reqs: list[Req]
    extend_lens: list[int]
    out_cache_loc: list[torch.Tensor]  # slot tensors, concatenated in request order (decodes in one)

    def subset(self, idx, req_to_token: torch.Tensor) -> ScheduleBatch:
        """Requests idx of the batch, each keeping the slots allocated to it: positions
        [kv_len, kv_len + n) of its row."""
        reqs, lens = [self.reqs[i] for i in idx], [self.extend_lens[i] for i in idx]
        assert all(r.alloc_len == r.kv_len + n for r, n in zip(reqs, lens))
        return ScheduleBatch(reqs, lens, [req_to_token[r.req_pool_idx, r.kv_len:r.kv_len + n]
                                          for r, n in zip(reqs, lens)])

    def halves(self, req_to_token: torch.Tensor) -> tuple[ScheduleBatch, ScheduleBatch]:
        """The batch in two, for running again as two steps (fault isolation)."""
        m, n = len(self.reqs) // 2, len(self.reqs)
        return self.subset(range(m), req_to_token), self.subset(range(m, n), req_to_token)

    def needs_logits(self, i: int) -> bool:
        r = self.reqs[i]
        return r.kv_len + self.extend_lens[i] == r.seq_len

    def to_forward_batch(self, kv: KVPool, req_to_token: torch.Tensor, device: torch.device,
                         group_shared: bool = False) -> ForwardBatch:
        ids, pos, logit_rows = [], [], []
        prefix, seq, starts = [], [], []
        t = 0
        for i, (r, n) in enumerate(zip(self.reqs, self.extend_lens)):
            ids.extend(r.tokens(r.kv_len, r.kv_len + n))
            pos.append(r.positions(r.kv_len, r.kv_len + n))
            prefix.append(r.kv_len)
            seq.append(r.kv_len + n)
            starts.append(t)
            if r.all_logits:
                logit_rows.extend(range(t, t + n))
            elif self.needs_logits(i):
                logit_rows.append(t + n - 1)
            t += n
        images = ImageBatch.build(self.reqs, self.extend_lens, device)
        # A one-token row may still be an image token (a chunk's end): run it as an extend.
        one = all(n == 1 for n in self.extend_lens) and images is None
        mode = ForwardMode.DECODE if one else ForwardMode.EXTEND

        def tensor(x):
            return torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True)

        if all(isinstance(p, range) for p in pos):
            positions = tensor([x for p in pos for x in p])
        else:  # M-RoPE rows: a one-row range is the same in all three
            positions = tensor([[x for p in pos for x in (p if isinstance(p, range) else p[k])]
                                for k in range(3)])
        return ForwardBatch(
            mode=mode, input_ids=tensor(ids), positions=positions,
            out_cache_loc=torch.cat(self.out_cache_loc).to(device),
            req_pool_indices=tensor([r.req_pool_idx for r in self.reqs]),
            seq_lens=tensor(seq), prefix_lens=tensor(prefix), extend_lens=tensor(self.extend_lens),
            extend_start_loc=tensor(starts), seq_lens_cpu=seq, prefix_lens_cpu=prefix,
            extend_lens_cpu=list(self.extend_lens), req_to_token=req_to_token, kv=kv,
            logits_idx=tensor(logit_rows), shared=self._shared_groups() if group_shared else None,
            images=images, lora=Loras.batch([r.lora for r in self.reqs], self.extend_lens, device))

    def _shared_groups(self) -> list[SharedGroup] | None:
        """Group one-token rows by the first radix node of their borrowed prefix; a group's
        common prefix is the longest run of nodes on every row's path."""
        paths: dict[int, list[tuple[int, list]]] = {}
        for i, (r, n) in enumerate(zip(self.reqs, self.extend_lens)):
            if n == 1 and r.prefix_len and r.last_node is not None:
                path, node = [], r.last_node
                while node.parent is not None:  # up to (not including) the root
                    path.append(node)
                    node = node.parent
                path.reverse()
                paths.setdefault(id(path[0]), []).append((i, path))
        out = []
        for members in paths.values():
            if len(members) < 2:
                continue
            common = 0
            for nodes in zip(*(path for _, path in members)):
                if any(x is not nodes[0] for x in nodes):
                    break
                common += len(nodes[0].key)
            if common >= self.SHARED_MIN:
                out.append(SharedGroup([i for i, _ in members], common))
        return out or None
