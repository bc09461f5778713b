"""The CPU decode-attention kernel (cpu_decode.c), built and loaded by cpu_build.py.

Why C: on a CPU, torch can attend over paged KV only after gathering each row's keys and
values into a dense copy, every layer of every step; at batch 64 on SmolLM2 that gather and
torch's flash kernel (built for blocks of queries, not the G heads of one token) were ~40% of
a decode step. The kernel reads the pool in place.
"""
from __future__ import annotations

import ctypes

import torch

from . import cpu_build
from .cpu_build import I64, P

MAX_HEAD_FLOATS = 16384  # Hq * D: a row's accumulators live on its thread's stack (64 KiB)


def load(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int):
    """The kernel as a ctypes function for a model of this dtype and these shapes, or None
    where it cannot be built or take them: fp32 only, head_dim a multiple of the CPU's vector
    width (4, 8 or 16 floats) and at most 16 vectors."""
    if dtype != torch.float32 or num_heads % num_kv_heads or num_heads * head_dim > MAX_HEAD_FLOATS:
        return None
    lib = cpu_build.library("cpu_decode")
    if lib is None:
        return None
    if not cpu_build.head_dim_fits(lib, head_dim):
        return None
    return cpu_build.bind(lib, "fanout_decode_attention",
                          [P, P, P, P, P, I64, P, P, P, I64, I64, I64, I64, ctypes.c_float, I64,
                           ctypes.c_float])


def decode_attention(fn, q: torch.Tensor, out: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                     table: torch.Tensor, rows: torch.Tensor, req: torch.Tensor,
                     lens: torch.Tensor, scale: float, window: int = 0,
                     softcap: float = 0.0) -> None:
    """out[rows] = attention of q[rows] over each row's first lens keys (slots table[req]),
    the last `window` of them when window > 0, its scores soft-capped when softcap > 0
    (softcap * tanh(s / softcap)). q, out [T, Hq, D] and kc, vc [slots, Hkv, D] contiguous
    fp32; table, rows, req, lens contiguous int64; every slot in range (the caller's
    invariant: the C code trusts it)."""
    _, Hq, D = q.shape
    fn(q.data_ptr(), out.data_ptr(), kc.data_ptr(), vc.data_ptr(), table.data_ptr(),
       table.stride(0), rows.data_ptr(), req.data_ptr(), lens.data_ptr(), rows.shape[0], Hq,
       kc.shape[1], D, scale, window, softcap)
