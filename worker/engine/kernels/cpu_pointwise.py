"""The per-row steps between a layer's matmuls on a CPU in fp32 (cpu_pointwise.c), built and
loaded by cpu_build.py: residual add + RMSNorm, and RoPE + the new tokens' K/V store; and the
sampler's picks from the logits: the greedy one (argmax), and a row's K largest (top_k).

Why C: with the matmuls in cpu_linear.c, what was left of a decode step's forward outside
them and attention was dozens of small torch ops a layer (RMSNorm's six, RoPE's dozen, the
K/V stores), each a few microseconds of dispatch around almost no work: on SmolLM2 at batch 8
about a quarter of the forward. Here they are three calls a layer.
"""
from __future__ import annotations

import ctypes

import torch

from . import cpu_build
from .cpu_build import I64, P

_fns: dict[str, object] = {}


def load() -> bool:
    """Whether the kernels are here (built, or built now); False where they cannot be built."""
    return cpu_build.functions("cpu_pointwise", _fns, {
        "add_rmsnorm": ("fanout_add_rmsnorm", [P, P, P, P, I64, I64, ctypes.c_float]),
        "rope_store": ("fanout_rope_store", [P, I64, I64, P, P, I64, I64, I64, P, P, P, P]),
        "argmax": ("fanout_argmax", [P, I64, I64, I64, P]),
        "top_k": ("fanout_top_k", [P, I64, I64, I64, I64, P, P], I64)})


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x (+ residual)) * weight, x (+ residual)) for x [M, D] float32. With a
    residual, the sum is written into x's own buffer where x is contiguous (a matmul's fresh
    output), else into a copy."""
    x = x.contiguous()
    if residual is not None:
        residual = residual.contiguous()
    out = torch.empty_like(x)
    _fns["add_rmsnorm"](x.data_ptr(), None if residual is None else residual.data_ptr(),
                        weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out, x


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
               num_kv_heads: int, kc: torch.Tensor, vc: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] (rows may be strided) -> q rotated [T, Hq, D]; k rotated and v
    written to kc, vc [pool slots, Hkv, D] (contiguous) at slots [T] (int64). cos, sin: the
    tokens' own angles, [T, D/2] or RotaryEmbedding's [T, 1, D/2]. Every slot in range (the
    caller's invariant: the C code trusts it)."""
    T, D = qkv.shape[0], kc.shape[2]
    cos, sin = cos.reshape(T, D // 2).contiguous(), sin.reshape(T, D // 2).contiguous()
    q = torch.empty(T, num_heads, D, dtype=torch.float32)
    _fns["rope_store"](qkv.data_ptr(), T, qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
                       num_heads, num_kv_heads, D, q.data_ptr(), kc.data_ptr(), vc.data_ptr(),
                       slots.data_ptr())
    return q


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.max(dim=-1).indices for x [M, N] float32 with unit column stride (rows may be strided):
    the first of equal maxima, a NaN counting as the largest. int64 [M]."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1 or x.shape[1] == 0:
        raise ValueError(f"cpu_pointwise.argmax: expected non-empty [M, N] float32 rows, got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
    idx = torch.empty(x.shape[0], dtype=torch.int64)
    _fns["argmax"](x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), idx.data_ptr())
    return idx


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest values of x [M, N] float32 (unit column stride, 0 < k < N) and their
    columns: [M, k] float32 and int64, larger first, equal values by column (a stable
    descending sort's order). A row holding a NaN gets k NaNs, at columns 0..k."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1 or not 0 < k < x.shape[1] < 2**31:
        raise ValueError(f"cpu_pointwise.top_k: expected [M, N > {k}] float32 rows, got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
    vals = torch.empty(x.shape[0], k, dtype=torch.float32)
    ids = torch.empty(x.shape[0], k, dtype=torch.int64)
    if _fns["top_k"](x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), k, vals.data_ptr(), ids.data_ptr()):
        raise MemoryError(f"cpu_pointwise.top_k: no memory for a buffer of {2 * k} values")
    return vals, ids
