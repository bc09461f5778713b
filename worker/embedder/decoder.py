"""A decoder embedding model (Qwen3-Embedding's kind: a causal LM whose last token's hidden
state is the vector) on the engine's model code (worker/engine/models), over a padded batch.

The engine's CausalLM runs as it does in a prefill, but its attention is dense and causal
over the batch's rows instead of the paged KV cache (no cache to fill: each input is run
once). Rows are padded at their end: under causal attention a real token never sees the
padding after it, so no mask is needed, and the pooled positions (the last real token, or the
mean of the real ones) are exact.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.engine.models.llama import CausalLM
from worker.engine.models.loader import load_model


class _Dense:
    """The attention the model's layers call (`fb.attn.forward(q, k, v, layer, fb)`), causal
    over [B, L] rows laid out as T = B * L tokens."""

    def __init__(self, B: int, L: int):
        self.B, self.L = B, L
        self.attn = self  # the model reads fb.attn

    def forward(self, q, k, v, layer_idx, fb):
        B, L = self.B, self.L
        T, nh, d = q.shape
        nkv = k.shape[1]

        def rows(x, n):
            return x.view(B, L, n, d).transpose(1, 2)

        o = F.scaled_dot_product_attention(rows(q, nh), rows(k, nkv), rows(v, nkv), is_causal=True,
                                           enable_gqa=nh != nkv)
        return o.transpose(1, 2).reshape(T, nh, d)


class Decoder:
    def __init__(self, path: str, config: dict, device, dtype, max_tokens: int):
        window = config.get("sliding_window")
        if window and config.get("use_sliding_window", True) and window < max_tokens:
            # The engine's model code attends to every earlier token (issue #40): refused, not wrong.
            raise ValueError(f"sliding_window {window} is shorter than the inputs taken ({max_tokens} "
                             "tokens): sliding-window attention is not supported")
        self.model, self.cfg = load_model(path, dtype, device, base_only=True)
        if type(self.model) is not CausalLM:  # a vision-language model's own forward
            raise ValueError(f"{self.cfg.architecture} is not supported as an embedding model (taken: the "
                             "text decoders of the engine's registry, and BERT)")
        self.device = torch.device(device)
        self.hidden = self.cfg.hidden_size

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """ids [B, L] (rows padded at their end) -> final-normed hidden states [B, L, H]."""
        B, L = ids.shape
        positions = torch.arange(L, device=ids.device).repeat(B)
        h = self.model(ids.reshape(-1), positions, _Dense(B, L))
        return h.view(B, L, -1)
