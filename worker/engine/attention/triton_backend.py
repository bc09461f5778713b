"""Triton attention over the paged KV cache: the GPU path (runs in the interpreter on a CPU).

DECODE batches go to the split-KV decode kernel, whose launch depends only on the batch
size and reads everything else from device tensors, so the CUDA graph runner can capture
`forward` with fixed-size inputs: its metadata is made once at capture and needs no refresh
at replay. Padded graph rows (seq_len 1, a req_to_token row of zeros, out_cache_loc 0) write
and read only scratch slot 0. EXTEND batches, including their one-token rows, go to the
extend kernel, which reads the new tokens' K/V back from the pool.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..batch import ForwardBatch, ForwardMode
from ..kernels.decode_attention import decode_attention
from ..kernels.extend_attention import extend_attention
from ..kernels.store_kv import store_kv
from .base import AttentionBackend, AttentionMetadata


@dataclass(slots=True)
class TritonMetadata(AttentionMetadata):
    max_extend_len: int  # sizes the extend kernel's grid (from the host list: 1 in decode)


class TritonBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 windows: tuple[int, ...] = (), softcap: float = 0.0, num_kv_splits: int = 8):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, windows, softcap)
        self.num_kv_splits = num_kv_splits

    def prepare(self, fb: ForwardBatch) -> TritonMetadata:
        return TritonMetadata(max(fb.extend_lens_cpu, default=0))

    def prepare_capture(self, fb: ForwardBatch) -> TritonMetadata:
        return TritonMetadata(1)

    def prepare_replay(self, fb: ForwardBatch, meta: AttentionMetadata) -> None:
        pass  # decode reads only fb's device tensors, already refreshed

    def store(self, k, v, layer, fb):
        store_kv(k, v, fb.kv.k[layer], fb.kv.v[layer], fb.out_cache_loc)

    def attend(self, q, layer, fb):
        kc, vc = fb.kv.k[layer], fb.kv.v[layer]
        if fb.mode == ForwardMode.DECODE:
            return decode_attention(q, kc, vc, fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                    self.scale, self.num_kv_splits, window=self.window(layer),
                                    softcap=self.softcap)
        return extend_attention(q, kc, vc, fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                fb.extend_start_loc, fb.extend_lens, fb.attn_meta.max_extend_len,
                                self.scale, window=self.window(layer), softcap=self.softcap)
