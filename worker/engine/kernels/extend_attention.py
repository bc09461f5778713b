"""Extend (prefill) attention over the paged KV cache.

Each request b brings extend_lens[b] new query tokens (rows extend_start_loc[b]... of q)
on top of a cached prefix of prefix_len = seq_lens[b] - extend_lens[b] tokens. The new
tokens' K/V must already be in the pool (the backend runs store_kv first), so every key,
prefix or new, is read through req_to_token[req_pool_indices[b], :seq_lens[b]]; query i of
the request sits at position prefix_len + i and sees keys 0..prefix_len + i (with a sliding
window, the last `window` of them).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .decode_attention import NO_WINDOW, softcap_log2


@triton.jit
def _extend_kernel(Q, KBuf, VBuf, Out, ReqToToken, ReqPool, SeqLens, StartLoc, ExtLens, scale_log2,
                   window,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_rt,
                   GROUP: tl.constexpr, D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   SOFTCAP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)  # block of BLOCK_M new tokens of request b
    ext_len = tl.load(ExtLens + b)
    if mb * BLOCK_M >= ext_len:  # the grid is sized for the longest request
        return
    seq_len = tl.load(SeqLens + b)
    prefix_len = seq_len - ext_len
    start = tl.load(StartLoc + b)
    req = tl.load(ReqPool + b)
    kv_head = h // GROUP

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < ext_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q = tl.load(Q + (start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q_pos = prefix_len + offs_m
    # Keys past the block's last query position are masked for every row: skip them; and,
    # with a window, the keys before its first query's window.
    end = tl.minimum(seq_len, prefix_len + (mb + 1) * BLOCK_M)
    lo = tl.maximum(prefix_len + mb * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(ReqToToken + req * stride_rt + offs_n, mask=mask_n, other=0)
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k = tl.load(KBuf + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
                    mask=mask_kv, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * scale_log2
        if SOFTCAP > 0:
            s = softcap_log2(s, SOFTCAP)
        # Causal, within the window: a row may see no key of a block (one before its window,
        # or a padding row's), so its max may be -inf: then nothing is added and nothing rescaled.
        visible = (mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
                   & (offs_n[None, :] > q_pos[:, None] - window))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(VBuf + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                    mask=mask_kv, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        m = m_new
    out = acc / tl.maximum(l, 1e-30)[:, None]  # l > 0 on every real row (it sees itself)
    tl.store(Out + (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, extend_start_loc: torch.Tensor, extend_lens: torch.Tensor,
                     max_extend_len: int, scale: float, out: torch.Tensor | None = None,
                     window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of the new tokens q [T, Hq, D] over prefix + new KV, read from the pool
    (each query over its last `window` positions when window > 0; the scores soft-capped when
    softcap > 0).

    k_buffer, v_buffer: [num_slots, Hkv, D], Hq a multiple of Hkv (GQA), holding the new
    tokens' K/V already. req_pool_indices, seq_lens, extend_start_loc, extend_lens: [B] int on
    q's device; max_extend_len: max(extend_lens), from the CPU lists (it sizes the grid).
    Returns [T, Hq, D] in q's dtype (written into `out` when given).
    """
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q: expected [T, Hq, D] with a contiguous last dim, got {tuple(q.shape)}")
    Hq, D = q.shape[1:]
    if (k_buffer.dim() != 3 or v_buffer.shape != k_buffer.shape or k_buffer.shape[2] != D
            or k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1):
        raise ValueError(f"k_buffer, v_buffer: expected equal [num_slots, Hkv, {D}] with a contiguous "
                         f"last dim, got {tuple(k_buffer.shape)} and {tuple(v_buffer.shape)}")
    Hkv = k_buffer.shape[1]
    if Hq % Hkv:
        raise ValueError(f"q: {Hq} heads is not a multiple of the {Hkv} kv heads")
    if req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        raise ValueError(f"req_to_token: expected a row-major [R, max_ctx] table, got {tuple(req_to_token.shape)}")
    B = seq_lens.shape[0]
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens),
                    ("extend_start_loc", extend_start_loc), ("extend_lens", extend_lens)):
        if t.shape != (B,):
            raise ValueError(f"{name}: expected shape [{B}], got {tuple(t.shape)}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B == 0 or max_extend_len <= 0:
        return out
    window = window if window > 0 else NO_WINDOW
    # 64x64 tiles of 16-bit K/V fit shared memory up to D=128; fp32 or bigger heads take 32.
    block = 64 if D <= 128 and k_buffer.element_size() <= 2 else 32
    grid = (B, Hq, triton.cdiv(max_extend_len, block))
    _extend_kernel[grid](
        q, k_buffer, v_buffer, out, req_to_token, req_pool_indices, seq_lens,
        extend_start_loc, extend_lens, scale * math.log2(math.e), window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=Hq // Hkv, D=D, BLOCK_M=block, BLOCK_N=block, BLOCK_D=triton.next_power_of_2(D),
        SOFTCAP=float(softcap),
        num_warps=4 if D <= 64 else 8, num_stages=2,
    )
    return out


def extend_attention_ref(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                         extend_start_loc, extend_lens, scale, window=0, softcap=0.0):
    """Plain torch, one request at a time, in fp32."""
    group = q.shape[1] // k_buffer.shape[1]
    out = torch.empty_like(q)
    for b in range(seq_lens.shape[0]):
        s, n, start = int(seq_lens[b]), int(extend_lens[b]), int(extend_start_loc[b])
        slots = req_to_token[req_pool_indices[b], :s]
        k = k_buffer[slots].float().repeat_interleave(group, dim=1)  # [s, Hq, D]
        v = v_buffer[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,shd->hns", q[start:start + n].float(), k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(s - n, s, device=q.device)
        keys = torch.arange(s, device=q.device)[None, :]
        visible = keys <= q_pos[:, None]  # [n, s]
        if window > 0:
            visible &= keys > q_pos[:, None] - window
        p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[start:start + n] = torch.einsum("hns,shd->nhd", p, v).to(q.dtype)
    return out
