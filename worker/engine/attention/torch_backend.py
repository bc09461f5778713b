"""Plain torch attention over the paged KV cache: the CPU path and the reference for Triton."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import AttentionBackend


@dataclass(slots=True)
class _Meta:
    # One-token rows (decode, or decode riding in an extend batch), attended in one batched call.
    dec_rows: torch.Tensor | None  # [Bd] positions in [T] of their new token
    dec_slots: torch.Tensor | None  # [Bd, L] KV slots, padded
    dec_mask: torch.Tensor | None  # [Bd, 1, 1, L] True where a key is visible
    # Multi-token rows: (start in [T], new tokens, KV slots [seq], causal mask [n, seq]).
    ext: list


class TorchBackend(AttentionBackend):
    def prepare(self, fb) -> None:
        dec, ext = [], []
        for i, n in enumerate(fb.extend_lens_cpu):
            (dec if n == 1 else ext).append(i)
        meta = _Meta(None, None, None, [])
        if dec:
            rows = fb.extend_start_loc[dec]
            lens = fb.seq_lens[dec]
            L = max(fb.seq_lens_cpu[i] for i in dec)
            slots = fb.req_to_token[fb.req_pool_indices[dec], :L]
            ar = torch.arange(L, device=slots.device)
            mask = ar[None, :] < lens[:, None]
            meta.dec_rows, meta.dec_slots, meta.dec_mask = rows, slots, mask[:, None, None, :]
        starts = fb.extend_start_loc.tolist() if ext else []
        for i in ext:
            n, s, p = fb.extend_lens_cpu[i], fb.seq_lens_cpu[i], fb.prefix_lens_cpu[i]
            slots = fb.req_to_token[fb.req_pool_indices[i], :s]
            q_pos = torch.arange(p, s, device=slots.device)
            k_pos = torch.arange(s, device=slots.device)
            meta.ext.append((starts[i], n, slots, k_pos[None, :] <= q_pos[:, None]))
        self.meta = meta

    def forward(self, q, k, v, layer, fb):
        kc, vc = fb.kv.k[layer], fb.kv.v[layer]
        kc[fb.out_cache_loc] = k.to(kc.dtype)
        vc[fb.out_cache_loc] = v.to(vc.dtype)
        m = self.meta
        out = torch.empty_like(q)
        gqa = self.num_heads != self.num_kv_heads
        if m.dec_rows is not None:
            qd = q[m.dec_rows].unsqueeze(2)  # [Bd, Hq, 1, D]
            kd = kc[m.dec_slots].transpose(1, 2).to(q.dtype)  # [Bd, Hkv, L, D]
            vd = vc[m.dec_slots].transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=m.dec_mask,
                                               scale=self.scale, enable_gqa=gqa)
            out[m.dec_rows] = o.squeeze(2)
        for start, n, slots, mask in m.ext:
            qe = q[start:start + n].transpose(0, 1)  # [Hq, n, D]
            ke = kc[slots].transpose(0, 1).to(q.dtype)  # [Hkv, s, D]
            ve = vc[slots].transpose(0, 1).to(q.dtype)
            o = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=mask,
                                               scale=self.scale, enable_gqa=gqa)
            out[start:start + n] = o.transpose(0, 1)
        return out
