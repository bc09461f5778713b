"""Plain torch attention over the paged KV cache: the CPU path and the reference for Triton.

On a CPU the cost is in gathering each request's K/V from the pool, so it is gathered by
whole pages: a position's slot is its page's first slot plus the offset in the page
(kv_manager.py keeps that so), so index_select over a [pages, page_size * Hkv * D] view of
the pool copies rows of a page each (3.3x faster than one index per slot, for a batch of 64
decode rows of ~300 tokens; fancy indexing of the 3-D pool is slower still). Positions past a
row's length in its last page are masked.
Query heads are grouped by their KV head (GQA) and attended as G queries per KV head,
so K/V are never repeated. Inputs are 4-D: torch's fused CPU kernel takes only those.

Decode rows that share a cached prefix (fb.shared: the samples of one prompt, a common
system prompt) attend to it once for the whole group, unmasked, and to the rest of their
own sequence separately; the two parts merge exactly through their log-sum-exps. That
needs the log-sum-exp that torch's CPU flash kernel returns but F.scaled_dot_product_attention
hides, so it runs on CPU tensors only (torch is pinned; a test checks it against plain SDPA).

On a CPU in fp32, decode rows go to the C kernel instead (kernels/cpu_decode.py) and prefill
rows to another (kernels/cpu_extend.py); both read the pool in place: no gather, no buckets,
no masks, and no shared-prefix groups (rows that share a prefix read the same pages, which are
then in cache). The torch path above remains where the kernels cannot be built and for other
dtypes, and is their reference in the tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..batch import ForwardBatch
from ..kernels import cpu_decode, cpu_extend
from .base import AttentionBackend, AttentionMetadata


@dataclass(slots=True)
class _Decode:
    """One-token rows of similar length (decode, or decode riding in an extend batch)."""
    rows: torch.Tensor  # [B] positions in [T] of their new token
    pages: torch.Tensor  # [B * L / page_size] KV pages, padded to L tokens per row
    mask: torch.Tensor  # [B, 1, 1, L] additive: 0 where a key is visible, -inf elsewhere
    length: int  # L


@dataclass(slots=True)
class _Shared:
    """One-token rows whose first p KV slots are the same slots."""
    rows: torch.Tensor  # [r] positions in [T]
    prefix: torch.Tensor  # [p / page_size] the common pages
    rest: torch.Tensor  # [r * L / page_size] each row's pages after the prefix, padded to L
    mask: torch.Tensor  # [r, 1, 1, L] additive
    length: int  # L


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(slots=True)
class _Extend:
    """A multi-token row."""
    start: int  # its first new token's position in [T]
    length: int  # new tokens
    pages: torch.Tensor  # [seq / page_size] its KV pages, seq padded to whole pages
    # [n, seq] additive, causal (and within the window); None for a row with no cached
    # prefix, no window and no soft cap: query i then sees keys 0..i, SDPA's own causal
    # alignment, which skips the masked half instead of adding -inf to it (the padding past
    # n is never seen)
    mask: torch.Tensor | None


@dataclass(slots=True)
class _Kernel:
    """The one-token rows, for the C kernel."""
    rows: torch.Tensor  # [B] positions in [T] of their token
    req: torch.Tensor  # [B] their rows of req_to_token
    lens: torch.Tensor  # [B] keys each attends to


@dataclass(slots=True)
class _ExtendKernel:
    """The multi-token rows, for the C prefill kernel."""
    starts: torch.Tensor  # [R] their first token's position in [T]
    counts: torch.Tensor  # [R] new tokens
    prefix: torch.Tensor  # [R] cached tokens before them
    req: torch.Tensor  # [R] their rows of req_to_token


@dataclass(slots=True)
class TorchMetadata(AttentionMetadata):
    dec: list[_Decode]  # one batched call each
    shared: list[_Shared]
    ext: list[_Extend]
    kernel: _Kernel | None = None
    ext_kernel: _ExtendKernel | None = None
    # The same batch's metadata for the layers with each sliding window (masks that hide the
    # keys before it; the C kernels take the window itself).
    windowed: dict[int, "TorchMetadata"] = field(default_factory=dict)


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
    def __init__(self, *args, device="cpu", dtype=torch.float32, cpu_kernel: bool = True, **kw):
        """cpu_kernel=False keeps decode on the torch path (the kernel's reference in tests)."""
        super().__init__(*args, **kw)
        cpu = torch.device(device).type == "cpu"
        shape = (dtype, self.num_heads, self.num_kv_heads, self.head_dim)
        self.kernel = cpu_decode.load(*shape) if cpu and cpu_kernel else None
        self.ext_kernel = cpu_extend.load(*shape) if cpu and cpu_kernel else None
        # The shared-prefix groups need torch's CPU flash kernel; the C kernel has no use for
        # them, nor do sliding windows (a row's window may not hold the whole shared prefix)
        # or soft-capped scores (the flash kernel cannot cap them).
        self.uses_shared_prefixes = (cpu and self.kernel is None and not any(self.windows)
                                     and not self.softcap)

    def prepare(self, fb: ForwardBatch) -> TorchMetadata:
        meta = self._prepare(fb, 0)
        # The C kernels take the window as an argument: only torch's rows need masks of their own.
        meta.windowed = {w: self._prepare(fb, w) if meta.dec or meta.ext else meta
                         for w in set(self.windows) - {0}}
        return meta

    def _prepare(self, fb: ForwardBatch, window: int) -> TorchMetadata:
        """The batch's metadata for layers that see the last `window` positions (0: all)."""
        dtype = fb.kv.k[0].dtype

        def additive(mask):  # SDPA takes a float mask without converting it on every call
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))

        dec, ext = [], []
        for i, n in enumerate(fb.extend_lens_cpu):
            (dec if n == 1 else ext).append(i)
        meta = TorchMetadata([], [], [])
        ps = fb.kv.page_size
        grouped = set()
        for g in (fb.shared or ()) if self.uses_shared_prefixes else ():
            grouped.update(g.rows)
            rtt = fb.req_to_token[fb.req_pool_indices[g.rows]]
            p = g.prefix_len  # whole pages: radix-tree nodes hold whole pages
            rest = rtt[:, p:max(fb.seq_lens_cpu[i] for i in g.rows):ps] // ps
            L = rest.shape[1] * ps
            own = torch.arange(p, p + L, device=rtt.device)[None, :] < fb.seq_lens[g.rows][:, None]
            meta.shared.append(_Shared(fb.extend_start_loc[g.rows], rtt[0, :p:ps] // ps,
                                       rest.reshape(-1), additive(own[:, None, None, :]), L))
        dec = [i for i in dec if i not in grouped]
        if dec and self.kernel is not None and dtype == torch.float32:  # (the pool's dtype)
            ids = dec if len(dec) < fb.batch_size else slice(None)
            meta.kernel = _Kernel(fb.extend_start_loc[ids].contiguous(),
                                  fb.req_pool_indices[ids].contiguous(), fb.seq_lens[ids].contiguous())
        elif dec:
            for bucket in _buckets([fb.seq_lens_cpu[i] for i in dec]):
                ids = [dec[j] for j in bucket]
                pages = fb.req_to_token[fb.req_pool_indices[ids], :max(fb.seq_lens_cpu[i] for i in ids):ps] // ps
                L = pages.shape[1] * ps
                keys, lens = torch.arange(L, device=pages.device)[None, :], fb.seq_lens[ids][:, None]
                mask = keys < lens
                if window:
                    mask &= keys >= lens - window
                meta.dec.append(_Decode(fb.extend_start_loc[ids], pages.reshape(-1),
                                        additive(mask[:, None, None, :]), L))
        if ext and self.ext_kernel is not None and dtype == torch.float32:
            ids = torch.tensor(ext, device=fb.extend_lens.device)
            meta.ext_kernel = _ExtendKernel(fb.extend_start_loc[ids], fb.extend_lens[ids],
                                            fb.prefix_lens[ids], fb.req_pool_indices[ids])
            ext = []
        starts = fb.extend_start_loc.tolist() if ext else []
        for i in ext:
            n, s, p = fb.extend_lens_cpu[i], fb.seq_lens_cpu[i], fb.prefix_lens_cpu[i]
            pages = fb.req_to_token[fb.req_pool_indices[i], :s:ps] // ps
            mask = None
            if p or window or self.softcap:
                q_pos = torch.arange(p, s, device=pages.device)[:, None]
                keys = torch.arange(pages.shape[0] * ps, device=pages.device)[None, :]
                visible = keys <= q_pos
                if window:
                    visible &= keys > q_pos - window
                mask = additive(visible)
            meta.ext.append(_Extend(starts[i], n, pages, mask))
        return meta

    def prepare_capture(self, fb: ForwardBatch) -> TorchMetadata:
        """A recorded CPU decode forward's (kernels/cpu_graph.py): every row to the C kernel,
        whose metadata views the static batch's own buffers, so it holds for every replay."""
        meta = self.prepare(fb)
        if meta.kernel is None or meta.dec or meta.shared:
            raise NotImplementedError("the torch backend records decode rows only where its C kernel runs them")
        return meta

    def prepare_replay(self, fb: ForwardBatch, meta: TorchMetadata) -> None:
        """Nothing to refresh: prepare_capture's metadata views the static buffers."""

    def store(self, k, v, layer, fb):
        kc, vc = fb.kv.k[layer], fb.kv.v[layer]
        S, Hkv, D = kc.shape
        kc.view(S, Hkv * D).index_copy_(0, fb.out_cache_loc, k.reshape(-1, Hkv * D).to(kc.dtype))
        vc.view(S, Hkv * D).index_copy_(0, fb.out_cache_loc, v.reshape(-1, Hkv * D).to(vc.dtype))

    def attend(self, q, layer, fb):
        kc, vc = fb.kv.k[layer], fb.kv.v[layer]
        S, Hkv, D = kc.shape
        ps = fb.kv.page_size
        kp, vp = kc.view(S // ps, ps * Hkv * D), vc.view(S // ps, ps * Hkv * D)  # a row a page
        window = self.window(layer)
        m = fb.attn_meta.windowed[window] if window else fb.attn_meta
        G = self.num_heads // Hkv
        if m.kernel is not None or m.ext_kernel is not None:
            q = q.contiguous()  # the kernels' layout, and so out's (empty_like keeps q's strides)
        out = torch.empty_like(q)
        if m.kernel is not None:
            cpu_decode.decode_attention(self.kernel, q, out, kc, vc, fb.req_to_token, m.kernel.rows,
                                        m.kernel.req, m.kernel.lens, self.scale, window, self.softcap)
        if m.ext_kernel is not None:
            e = m.ext_kernel
            cpu_extend.extend_attention(self.ext_kernel, q, out, kc, vc, fb.req_to_token, e.starts,
                                        e.counts, e.prefix, e.req, self.scale, window, self.softcap)
        for d in m.dec:
            B, L = d.mask.shape[0], d.length
            qd = q[d.rows].view(B, Hkv, G, D)
            kd = kp.index_select(0, d.pages).view(B, L, Hkv, D).transpose(1, 2).to(q.dtype)
            vd = vp.index_select(0, d.pages).view(B, L, Hkv, D).transpose(1, 2).to(q.dtype)
            o = self._sdpa(qd, kd, vd, d.mask)
            out[d.rows] = o.reshape(B, Hkv * G, D)
        for g in m.shared:
            out[g.rows] = self._shared(q[g.rows], kp, vp, g, Hkv, G, D)
        for e in m.ext:
            s, start, n = e.pages.shape[0] * ps, e.start, e.length
            qe = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            ke = kp.index_select(0, e.pages).view(s, Hkv, D).transpose(0, 1).unsqueeze(0).to(q.dtype)
            ve = vp.index_select(0, e.pages).view(s, Hkv, D).transpose(0, 1).unsqueeze(0).to(q.dtype)
            if self.softcap:  # SDPA cannot cap the scores: plain attention (the mask is explicit then)
                o = self._sdpa(qe.reshape(1, Hkv, G * n, D), ke, ve, e.mask.repeat(G, 1)[None, None])
                o = o.reshape(1, Hkv * G, n, D)
            else:
                o = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=e.mask, is_causal=e.mask is None,
                                                   scale=self.scale, enable_gqa=G > 1)
            out[start:start + n] = o[0].transpose(0, 1)
        return out

    def _sdpa(self, q, k, v, mask):
        """q [B, Hkv, G, D] (a kv head's queries together) against k, v [B, Hkv, L, D] under an
        additive mask broadcast to [B, Hkv, G, L]: SDPA, or the same in plain ops with the
        scores soft-capped."""
        if not self.softcap:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        s = (q @ k.transpose(-1, -2)).float() * self.scale
        s = self.softcap * torch.tanh(s / self.softcap) + mask
        return torch.softmax(s, dim=-1).to(v.dtype) @ v

    def _shared(self, q, kp, vp, g: _Shared, Hkv: int, G: int, D: int) -> torch.Tensor:
        """kp, vp: the layer's pools, a row a page."""
        r, L = q.shape[0], g.length
        # The common prefix: every query of the group against it, unmasked.
        qs = q.view(r, Hkv, G, D).transpose(0, 1).reshape(1, Hkv, r * G, D)
        kx = kp.index_select(0, g.prefix).view(-1, Hkv, D).transpose(0, 1).unsqueeze(0).to(q.dtype)
        vx = vp.index_select(0, g.prefix).view(-1, Hkv, D).transpose(0, 1).unsqueeze(0).to(q.dtype)
        o1, l1 = _flash_cpu(qs, kx, vx, scale=self.scale)
        o1 = o1.view(Hkv, r, G, D).transpose(0, 1)
        l1 = l1.view(Hkv, r, G).transpose(0, 1)
        # The rest of each row's own sequence.
        qr = q.view(r, Hkv, G, D)
        kr = kp.index_select(0, g.rest).view(r, L, Hkv, D).transpose(1, 2).to(q.dtype)
        vr = vp.index_select(0, g.rest).view(r, L, Hkv, D).transpose(1, 2).to(q.dtype)
        o2, l2 = _flash_cpu(qr, kr, vr, attn_mask=g.mask, scale=self.scale)
        lse = torch.logaddexp(l1, l2)
        o = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
        return o.reshape(r, Hkv * G, D).to(q.dtype)
