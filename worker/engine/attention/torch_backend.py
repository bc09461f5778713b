"""Plain torch attention over the paged KV cache: the CPU path and the reference for Triton.

On a CPU the cost is in gathering each request's K/V rows from the pool; index_select
on a 2-D view of the pool is several times faster than fancy indexing of the 3-D one.
Query heads are grouped by their KV head (GQA) and attended as G queries per KV head,
so K/V are never repeated. Inputs are 4-D: torch's fused CPU kernel takes only those.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import AttentionBackend


@dataclass(slots=True)
class _Decode:
    """One-token rows of similar length (decode, or decode riding in an extend batch)."""
    rows: torch.Tensor  # [B] positions in [T] of their new token
    slots: torch.Tensor  # [B * L] KV slots, padded to L per row
    mask: torch.Tensor  # [B, 1, 1, L] additive: 0 where a key is visible, -inf elsewhere
    length: int  # L


@dataclass(slots=True)
class _Shared:
    """One-token rows whose prefixes share cached KV (fb.shared): their queries attend in one
    call to the union of their slots, each row masked to its own, so a shared prefix is
    gathered and read once for the whole group."""
    rows: torch.Tensor  # [r] positions in [T]
    slots: torch.Tensor  # [K]
    mask: torch.Tensor  # [r * G, K] additive


@dataclass(slots=True)
class _Meta:
    dec: list  # list[_Decode]: one batched call each
    shared: list  # list[_Shared]
    # Multi-token rows: (start in [T], new tokens, KV slots [seq], additive causal mask [n, seq]).
    ext: list


def _buckets(lens: list[int], max_buckets: int = 4) -> list[list[int]]:
    """Split row ids, sorted by length, where padding to the bucket's longest would waste
    more than a third: rows of mixed lengths cost about their own length, not the longest."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    out = [[order[0]]]
    for i in order[1:]:
        first = lens[out[-1][0]]
        if len(out) < max_buckets and lens[i] > 1.5 * first + 64:
            out.append([i])
        else:
            out[-1].append(i)
    return out


class TorchBackend(AttentionBackend):
    def prepare(self, fb) -> None:
        dtype = fb.kv.k[0].dtype

        def additive(mask):  # SDPA takes a float mask without converting it on every call
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))

        dec, ext = [], []
        for i, n in enumerate(fb.extend_lens_cpu):
            (dec if n == 1 else ext).append(i)
        meta = _Meta([], [], [])
        group = self.num_heads // self.num_kv_heads
        grouped = set()
        for g in fb.shared or ():
            grouped.update(g.rows)
            meta.shared.append(_Shared(fb.extend_start_loc[g.rows], g.slots,
                                       additive(g.mask.repeat_interleave(group, 0))))
        dec = [i for i in dec if i not in grouped]
        if dec:
            for bucket in _buckets([fb.seq_lens_cpu[i] for i in dec]):
                ids = [dec[j] for j in bucket]
                L = max(fb.seq_lens_cpu[i] for i in ids)
                slots = fb.req_to_token[fb.req_pool_indices[ids], :L]
                mask = torch.arange(L, device=slots.device)[None, :] < fb.seq_lens[ids][:, None]
                meta.dec.append(_Decode(fb.extend_start_loc[ids], slots.reshape(-1),
                                        additive(mask[:, None, None, :]), L))
        starts = fb.extend_start_loc.tolist() if ext else []
        for i in ext:
            n, s, p = fb.extend_lens_cpu[i], fb.seq_lens_cpu[i], fb.prefix_lens_cpu[i]
            slots = fb.req_to_token[fb.req_pool_indices[i], :s]
            q_pos = torch.arange(p, s, device=slots.device)
            mask = torch.arange(s, device=slots.device)[None, :] <= q_pos[:, None]
            meta.ext.append((starts[i], n, slots, additive(mask)))
        self.meta = meta

    def forward(self, q, k, v, layer, fb):
        kc, vc = fb.kv.k[layer], fb.kv.v[layer]
        S, Hkv, D = kc.shape
        kc2, vc2 = kc.view(S, Hkv * D), vc.view(S, Hkv * D)
        kc2.index_copy_(0, fb.out_cache_loc, k.reshape(-1, Hkv * D).to(kc.dtype))
        vc2.index_copy_(0, fb.out_cache_loc, v.reshape(-1, Hkv * D).to(vc.dtype))
        m = self.meta
        G = self.num_heads // Hkv
        out = torch.empty_like(q)
        for d in m.dec:
            B, L = d.mask.shape[0], d.length
            qd = q[d.rows].view(B, Hkv, G, D)
            kd = kc2.index_select(0, d.slots).view(B, L, Hkv, D).transpose(1, 2).to(q.dtype)
            vd = vc2.index_select(0, d.slots).view(B, L, Hkv, D).transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=self.scale)
            out[d.rows] = o.reshape(B, Hkv * G, D)
        for g in m.shared:
            out[g.rows] = self._shared(q[g.rows], kc2, vc2, g, Hkv, G, D)
        for start, n, slots, mask in m.ext:
            s = slots.shape[0]
            qe = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            ke = kc2.index_select(0, slots).view(s, Hkv, D).transpose(0, 1).unsqueeze(0).to(q.dtype)
            ve = vc2.index_select(0, slots).view(s, Hkv, D).transpose(0, 1).unsqueeze(0).to(q.dtype)
            o = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=mask, scale=self.scale,
                                               enable_gqa=G > 1)
            out[start:start + n] = o[0].transpose(0, 1)
        return out

    def _shared(self, q, kc2, vc2, g: _Shared, Hkv: int, G: int, D: int) -> torch.Tensor:
        r, n = q.shape[0], g.slots.shape[0]
        qs = q.view(r, Hkv, G, D).transpose(0, 1).reshape(1, Hkv, r * G, D)
        k = kc2.index_select(0, g.slots).view(n, Hkv, D).transpose(0, 1).unsqueeze(0).to(q.dtype)
        v = vc2.index_select(0, g.slots).view(n, Hkv, D).transpose(0, 1).unsqueeze(0).to(q.dtype)
        # 4-D inputs take torch's fused CPU kernel; 3-D ones a much slower path.
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=g.mask, scale=self.scale)
        return o.view(Hkv, r, G, D).transpose(0, 1).reshape(r, Hkv * G, D)
