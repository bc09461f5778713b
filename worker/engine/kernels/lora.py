"""Batched LoRA on a GPU: each token's row multiplied by its own adapter's A, then B.

The adapters' weights are stacked by slot (lora.py): `a` [S, NR, K] (a projection's
sub-projections' A, each padded to the max rank with zeros) and `b` [S, N, NR] (each
sub-projection's B in its rows and columns, zeros elsewhere); slot 0 is the base model's,
all zeros and skipped. Two kernels, as Punica's shrink and expand:
- shrink: xa[t] = x[t] @ a[slot[t]].T  ([T, K] -> [T, NR], float32);
- expand: out[t] += xa[t] @ b[slot[t]].T  ([T, NR] -> [T, N]).
One program per (token, block of outputs): a token of the base (slot 0) does nothing.
`lora_ref` is the torch reference the tests hold them to.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(X, A, Slots, XA, K, NR, stride_xt, stride_as, stride_ar, stride_xat,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(Slots + t)
    if slot == 0:
        return
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + t * stride_xt + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        a = tl.load(A + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :],
                    mask=(offs_r[:, None] < NR) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(XA + t * stride_xat + offs_r, acc, mask=offs_r < NR)


@triton.jit
def _expand_kernel(XA, B, Slots, Out, N, R, stride_xat, stride_bs, stride_bn, stride_ot,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(Slots + t)
    if slot == 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for q0 in range(0, R, BLOCK_R):
        offs_r = q0 + tl.arange(0, BLOCK_R)
        xa = tl.load(XA + t * stride_xat + offs_r, mask=offs_r < R, other=0.0)
        b = tl.load(B + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                    mask=(offs_n[:, None] < N) & (offs_r[None, :] < R), other=0.0).to(tl.float32)
        acc += tl.sum(b * xa[None, :], axis=1)
    ptr = Out + t * stride_ot + offs_n
    old = tl.load(ptr, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(ptr, (old + acc).to(Out.dtype.element_ty), mask=offs_n < N)


def lora_add(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slots: torch.Tensor) -> torch.Tensor:
    """out[t] += (x[t] @ a[slot[t]].T) @ b[slot[t]].T for every token t whose slot is not 0;
    returns out (changed in place). x [T, K], out [T, N]: last dims contiguous; a [S, NR, K],
    b [S, N, NR]: contiguous; slots [T] int32 or int64, each < S."""
    T, K = x.shape
    _, NR, _ = a.shape
    N = b.shape[1]
    if T == 0:
        return out
    if x.stride(1) != 1 or out.stride(1) != 1 or not a.is_contiguous() or not b.is_contiguous():
        raise ValueError("lora_add: x, out: last dim contiguous; a, b: contiguous")
    xa = torch.empty(T, NR, device=x.device, dtype=torch.float32)
    block_r = min(64, triton.next_power_of_2(NR))
    _shrink_kernel[(T, triton.cdiv(NR, block_r))](x, a, slots, xa, K, NR, x.stride(0), a.stride(0), a.stride(1),
                                                  xa.stride(0), BLOCK_R=block_r, BLOCK_K=64)
    _expand_kernel[(T, triton.cdiv(N, 64))](xa, b, slots, out, N, NR, xa.stride(0), b.stride(0),
                                           b.stride(1), out.stride(0), BLOCK_N=64, BLOCK_R=block_r)
    return out


def lora_ref(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slots: torch.Tensor) -> torch.Tensor:
    """lora_add in torch, token by token."""
    for t, slot in enumerate(slots.tolist()):
        if slot:
            y = (x[t].float() @ a[slot].float().t()) @ b[slot].float().t()
            out[t] = (out[t].float() + y).to(out.dtype)
    return out
