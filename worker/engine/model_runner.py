"""Loads the model, sizes the KV pool, and runs one forward pass per ForwardBatch."""
from __future__ import annotations

import logging

import torch

from .attention.base import make_backend
from .kv_pool import KVPool, ReqToTokenPool
from .models.loader import load_model

log = logging.getLogger("fanout.engine")


class ModelRunner:
    def __init__(self, model_path: str, device: torch.device, dtype: torch.dtype, page_size: int,
                 kv_tokens: int | None, kv_memory_fraction: float, max_running: int,
                 attention_backend: str = "auto"):
        self.device = device
        self.dtype = dtype
        self.model, self.config = load_model(model_path, dtype, device)
        c = self.config
        self.max_context = c.max_context
        self.page_size = page_size
        per_token = KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, dtype)
        if kv_tokens is None:
            kv_tokens = self._default_kv_tokens(per_token, kv_memory_fraction)
        num_pages = max(2, kv_tokens // page_size + 1)  # +1: the scratch page
        self.kv = KVPool(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, dtype, device)
        self.kv_tokens = (num_pages - 1) * page_size
        log.info("KV pool: %d tokens (%d pages of %d), %.1f MiB", self.kv_tokens, num_pages - 1,
                 page_size, self.kv_tokens * per_token / 2**20)
        # One extra row: a scratch row whose slots are all the scratch page (padding).
        self.req_to_token = ReqToTokenPool(max_running + 1, c.max_context, device)
        self.attn = make_backend(attention_backend, device, num_heads=c.num_heads,
                                 num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)

    def _default_kv_tokens(self, per_token: int, fraction: float) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * fraction) // per_token
        # CPU: enough for many full-context requests, at most 2 GiB.
        return min(2 * 2**30 // per_token, 64 * self.max_context)

    @torch.inference_mode()
    def forward(self, fb) -> torch.Tensor:
        """Logits [len(fb.logits_idx), vocab] in float32."""
        fb.attn = self.attn
        self.attn.prepare(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        return self.model.logits(hidden[fb.logits_idx])
