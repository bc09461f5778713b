"""Write the new tokens' K/V into their slots of the paged KV buffers."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(K, V, KBuf, VBuf, Loc,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kbs, stride_kbh, stride_vbs, stride_vbh,
                     H: tl.constexpr, D: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)  # one program per new token: all its heads at once
    slot = tl.load(Loc + t)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(KBuf + slot * stride_kbs + offs_h[:, None] * stride_kbh + offs_d[None, :],
             k.to(KBuf.dtype.element_ty), mask=mask)
    tl.store(VBuf + slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_d[None, :],
             v.to(VBuf.dtype.element_ty), mask=mask)


def _check(k, v, k_buffer, v_buffer, loc):
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k, v: expected equal shapes [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_buffer.dim() != 3 or v_buffer.shape != k_buffer.shape or k_buffer.shape[1:] != k.shape[1:]:
        raise ValueError(f"k_buffer, v_buffer: expected [num_slots, {k.shape[1]}, {k.shape[2]}], "
                         f"got {tuple(k_buffer.shape)} and {tuple(v_buffer.shape)}")
    if k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        raise ValueError("k_buffer, v_buffer: last dim must be contiguous")
    if loc.shape != (k.shape[0],):
        raise ValueError(f"loc: expected shape [{k.shape[0]}], got {tuple(loc.shape)}")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
             loc: torch.Tensor) -> None:
    """k_buffer[loc[t]] = k[t] and v_buffer[loc[t]] = v[t], cast to the buffers' dtype.

    k, v: [T, Hkv, D], last dim contiguous (views of a fused qkv projection are fine).
    Slots in `loc` must be distinct (padded rows of a CUDA graph may all share scratch slot 0:
    then which one lands there does not matter).
    """
    _check(k, v, k_buffer, v_buffer, loc)
    T, H, D = k.shape
    if T == 0:
        return
    k, v = _inner_contiguous(k), _inner_contiguous(v)
    _store_kv_kernel[(T,)](
        k, v, k_buffer, v_buffer, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        H=H, D=D, BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D),
    )


def _inner_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv_ref(k, v, k_buffer, v_buffer, loc) -> None:
    k_buffer[loc] = k.to(k_buffer.dtype)
    v_buffer[loc] = v.to(v_buffer.dtype)
