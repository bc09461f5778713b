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

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
