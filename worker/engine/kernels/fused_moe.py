"""A mixture of experts' MLP on the GPU (models/moe.py): each expert's matmuls over the tokens
routed to it, in Triton, with no host sync.

`align` sorts the (token, expert) pairs by expert on the device and pads each expert's run to
a whole number of BLOCK_M-row blocks: `sorted_ids` holds the pairs' indices (the padding the
sentinel num_pairs), `block_expert` each block's expert (-1 past the last). Their sizes
depend only on the number of pairs, so a CUDA graph could hold them. `expert_matmul` runs a
block of rows against its expert's weight: program (block, column tile) computes
out[pair, n] = sum_k in[row of pair, k] * W[expert, n, k] (times the pair's routing weight
when given), the rows of pairs gathered in place: the first matmul reads the token (pair //
top_k) of each pair, the second the pair's own row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # pair rows a program takes (tl.dot needs 16)


def align(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, top_k] -> (sorted_ids [P], block_expert [P / block_m]), P = T * top_k +
    num_experts * (block_m - 1) rounded up to block_m: enough for any routing."""
    flat = experts.flatten()
    n, dev = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts  # each expert's first pair in `order`
    pad_start = torch.cumsum(padded, 0) - padded  # ... and its first row in sorted_ids
    e = flat[order]
    pos = pad_start[e] + torch.arange(n, device=dev) - start[e]
    size = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((size,), n, dtype=torch.int64, device=dev).scatter_(0, pos, order)
    first_row = torch.arange(0, size, block_m, device=dev)
    block_expert = torch.searchsorted(torch.cumsum(padded, 0), first_row, right=True)
    return sorted_ids, torch.where(block_expert < num_experts, block_expert, -1)


@triton.jit
def _expert_matmul(A, W, Out, Weights, SortedIds, BlockExpert, num_pairs, N, K, stride_am, stride_we,
                   stride_wn, stride_om, ROW_DIV: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(BlockExpert + pid_m)
    if e >= 0:
        ids = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = ids < num_pairs
        rows = ids // ROW_DIV
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = tl.load(A + rows[:, None] * stride_am + offs_k[None, :],
                        mask=valid[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(W + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
                        mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc += tl.dot(a, w.to(a.dtype), input_precision="ieee")
        if HAS_WEIGHTS:
            acc = acc * tl.load(Weights + ids, mask=valid, other=0.0)[:, None]
        tl.store(Out + ids[:, None] * stride_om + offs_n[None, :], acc.to(Out.dtype.element_ty),
                 mask=valid[:, None] & mask_n[None, :])


def expert_matmul(a: torch.Tensor, w: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                  num_pairs: int, row_div: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """out [num_pairs, N]: row p = a[p // row_div] @ w[expert of p].T (times weights[p]).
    a [rows, K] with a contiguous last dim; w [E, N, K] contiguous; weights [num_pairs] fp32."""
    E, N, K = w.shape
    if a.shape[1] != K or a.stride(1) != 1 or not w.is_contiguous():
        raise ValueError(f"a [rows, {K}] (last dim contiguous) and w [E, N, K] contiguous expected, got "
                         f"{tuple(a.shape)} and {tuple(w.shape)}")
    out = torch.empty((num_pairs, N), dtype=a.dtype, device=a.device)
    block_n, block_k = 32, 32
    grid = (block_expert.numel(), triton.cdiv(N, block_n))
    _expert_matmul[grid](a, w, out, weights if weights is not None else out, sorted_ids, block_expert,
                         num_pairs, N, K, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
                         ROW_DIV=row_div, HAS_WEIGHTS=weights is not None, BLOCK_M=BLOCK_M,
                         BLOCK_N=block_n, BLOCK_K=block_k)
    return out
