"""Decode attention over the paged KV cache: one query token per request, split-KV.

Stage 1 cuts each request's KV into `num_kv_splits` chunks and computes, per chunk, the
softmax-normalised partial output and its log-sum-exp; stage 2 merges the chunks. Splitting
keeps the GPU busy when the batch is small and the sequences are long ("flash decoding").
The grids depend only on the batch size and head counts, and the kernels read `seq_lens`,
`req_pool_indices` and `req_to_token` from device memory, so a CUDA graph can capture them.
Log-sum-exps are kept in base 2 (exp2 is the cheap instruction).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_H = 16  # query heads per stage-1 program (tl.dot needs >= 16 rows); extra rows masked
BLOCK_N = 32  # keys per loop step; each split's chunk is a multiple of it
NO_WINDOW = 1 << 30  # the window the kernels get for none: longer than any sequence
LOG2E = 1.4426950408889634


@triton.jit
def softcap_log2(s, SOFTCAP: tl.constexpr):
    """Scores in base 2 (natural ones times LOG2E) -> soft-capped as SOFTCAP * tanh(natural /
    SOFTCAP) (Gemma 2's), still in base 2; tanh from exp, which the interpreter has too."""
    x = s / (LOG2E * SOFTCAP)
    return SOFTCAP * LOG2E * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


@triton.jit
def _stage1(Q, KBuf, VBuf, ReqToToken, ReqPool, SeqLens, MidO, MidLse, scale_log2, window,
            stride_qb, stride_qh, stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_rt,
            stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
            GROUP: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
            BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr):
    b = tl.program_id(0)
    hb = tl.program_id(1)  # a block of query heads that share one kv head
    split = tl.program_id(2)
    BLOCKS_PER_KV: tl.constexpr = (GROUP + BLOCK_H - 1) // BLOCK_H
    kv_head = hb // BLOCKS_PER_KV
    in_group = (hb % BLOCKS_PER_KV) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = in_group < GROUP
    heads = kv_head * GROUP + in_group
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D

    seq_len = tl.load(SeqLens + b)
    req = tl.load(ReqPool + b)
    lo = tl.maximum(seq_len - window, 0)  # the keys before the window are not read
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    if end > start:
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            slots = tl.load(ReqToToken + req * stride_rt + offs_n, mask=mask_n, other=0)
            mask_kv = mask_n[:, None] & mask_d[None, :]
            k = tl.load(KBuf + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
                        mask=mask_kv, other=0.0)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * scale_log2
            if SOFTCAP > 0:
                s = softcap_log2(s, SOFTCAP)
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(VBuf + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                        mask=mask_kv, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
            m = m_new
        tl.store(MidO + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :],
                 acc / l[:, None], mask=mask_h[:, None] & mask_d[None, :])
        tl.store(MidLse + b * stride_mlb + heads * stride_mlh + split, m + tl.log2(l), mask=mask_h)


@triton.jit
def _stage2(MidO, MidLse, SeqLens, Out, window,
            stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
            D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    seq_len = tl.load(SeqLens + b)
    lo = tl.maximum(seq_len - window, 0)  # as in stage 1
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    m = float("-inf")
    l = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for split in range(NUM_SPLITS):
        if lo + split * chunk < seq_len:  # stage 1 wrote this split
            lse = tl.load(MidLse + b * stride_mlb + h * stride_mlh + split)
            o = tl.load(MidO + b * stride_mob + h * stride_moh + split * stride_mos + offs_d,
                        mask=mask_d, other=0.0)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            acc = acc * alpha + o * w
            l = l * alpha + w
            m = m_new
    # l >= 1 once any split was seen (the largest lse weighs 1); seq_len 0 gives zeros.
    out = acc / tl.maximum(l, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_kv_splits: int = 8,
                     out: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """out[b, h] = softmax(q[b, h] . K_b^T * scale) V_b over keys 0..seq_lens[b]-1 of request b
    (the last `window` of them when window > 0), whose KV slots are
    req_to_token[req_pool_indices[b], :seq_lens[b]]; the scores soft-capped when softcap > 0.

    q: [B, Hq, D]; k_buffer, v_buffer: [num_slots, Hkv, D] with Hq a multiple of Hkv (GQA);
    req_to_token: [R, max_ctx] int; req_pool_indices, seq_lens: [B] int. Returns [B, Hq, D]
    in q's dtype (written into `out` when given). No host sync: safe inside a CUDA graph.
    """
    B, Hq, D = _check(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, num_kv_splits)
    Hkv = k_buffer.shape[1]
    group = Hq // Hkv
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    window = window if window > 0 else NO_WINDOW
    mid_o = torch.empty((B, Hq, num_kv_splits, D), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((B, Hq, num_kv_splits), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(D)
    grid1 = (B, Hkv * triton.cdiv(group, BLOCK_H), num_kv_splits)
    _stage1[grid1](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        scale * math.log2(math.e), window,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, D=D, NUM_SPLITS=num_kv_splits, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        SOFTCAP=float(softcap), num_warps=4, num_stages=2,
    )
    _stage2[(B, Hq)](
        mid_o, mid_lse, seq_lens, out, window,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        D=D, NUM_SPLITS=num_kv_splits, BLOCK_N=BLOCK_N, BLOCK_D=block_d, num_warps=4,
    )
    return out


def _check(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, num_kv_splits):
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q: expected [B, Hq, D] with a contiguous last dim, got {tuple(q.shape)}")
    B, Hq, D = q.shape
    if (k_buffer.dim() != 3 or v_buffer.shape != k_buffer.shape or k_buffer.shape[2] != D
            or k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1):
        raise ValueError(f"k_buffer, v_buffer: expected equal [num_slots, Hkv, {D}] with a contiguous "
                         f"last dim, got {tuple(k_buffer.shape)} and {tuple(v_buffer.shape)}")
    if Hq % k_buffer.shape[1]:
        raise ValueError(f"q: {Hq} heads is not a multiple of the {k_buffer.shape[1]} kv heads")
    if req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        raise ValueError(f"req_to_token: expected a row-major [R, max_ctx] table, got {tuple(req_to_token.shape)}")
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)):
        if t.shape != (B,):
            raise ValueError(f"{name}: expected shape [{B}], got {tuple(t.shape)}")
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits: must be >= 1, got {num_kv_splits}")
    return B, Hq, D


def decode_attention_ref(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale,
                         window=0, softcap=0.0):
    """Plain torch, one request at a time, in fp32."""
    group = q.shape[1] // k_buffer.shape[1]
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        slots = req_to_token[req_pool_indices[b], max(0, n - window) if window > 0 else 0:n]
        k = k_buffer[slots].float().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v_buffer[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", q[b].float(), k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        p = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hs,shd->hd", p, v).to(q.dtype)
    return out
