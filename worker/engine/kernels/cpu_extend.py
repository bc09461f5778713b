"""The CPU prefill-attention kernel (cpu_extend.c), built and loaded by cpu_build.py.

Why C: torch's CPU flash kernel took ~11% of a chat batch's prefill on SmolLM2 (9 heads of 64,
prompts of ~240 tokens: ~35 GFLOP/s, against ~190 for the matmuls beside it), on top of
gathering each request's K/V pages into a dense copy first. The kernel reads the pool in
place and computes a block of keys' scores as vectors.
"""
from __future__ import annotations

import ctypes

import torch

from . import cpu_build
from .cpu_build import I64, P


def load(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int):
    """The kernel as a ctypes function for a model of this dtype and these shapes, or None
    where it cannot be built or take them: fp32 only, a kv head's query heads within one task
    (the library's fanout_extend_qn()), head_dim a multiple of the CPU's vector width and at
    most 16 vectors."""
    if dtype != torch.float32 or num_heads % num_kv_heads:
        return None
    lib = cpu_build.library("cpu_extend")
    if lib is None:
        return None
    qn = cpu_build.bind(lib, "fanout_extend_qn", [], I64)()
    if num_heads // num_kv_heads > qn or not cpu_build.head_dim_fits(lib, head_dim):
        return None
    return cpu_build.bind(lib, "fanout_extend_attention",
                          [P, P, P, P, P, I64, P, P, P, P, I64, I64, I64, I64, ctypes.c_float, I64,
                           ctypes.c_float])


def extend_attention(fn, q: torch.Tensor, out: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                     table: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                     prefix: torch.Tensor, req: torch.Tensor, scale: float, window: int = 0,
                     softcap: float = 0.0) -> None:
    """For each request r: out rows starts[r] .. + counts[r] = causal attention of those q rows
    (positions prefix[r] on) over the request's keys up to each one's position (the last
    `window` of them when window > 0; slots table[req[r]], the new tokens' K/V stored), the
    scores soft-capped when softcap > 0 (softcap * tanh(s / softcap)). q, out [T, Hq, D] and
    kc, vc [slots, Hkv, D] contiguous fp32; the rest contiguous int64; every slot in range
    (the C code trusts it)."""
    _, Hq, D = q.shape
    fn(q.data_ptr(), out.data_ptr(), kc.data_ptr(), vc.data_ptr(), table.data_ptr(),
       table.stride(0), starts.data_ptr(), counts.data_ptr(), prefix.data_ptr(), req.data_ptr(),
       starts.shape[0], Hq, kc.shape[1], D, scale, window, softcap)
