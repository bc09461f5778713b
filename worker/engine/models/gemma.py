"""Gemma 2 and Gemma 3's text model (Gemma2ForCausalLM, Gemma3ForCausalLM): the Llama family's
attention and gated MLP with Gemma's own parts, as transformers runs them:

- RMSNorm with (1 + weight), computed in fp32 and cast back once;
- four norms a layer: the attention's and the MLP's outputs are normed before their residual
  adds, as well as their inputs;
- embeddings scaled by sqrt(hidden_size) (rounded to the model's dtype);
- attention scores scaled by query_pre_attn_scalar ** -0.5; Gemma 3 norms q and k per head,
  Gemma 2 soft-caps the scores (attn_logit_softcapping: the attention backend's `softcap`);
- sliding-window layers (ModelConfig.windows: every other layer on Gemma 2, 5 of 6 on
  Gemma 3's checkpoints); Gemma 3's have their own RoPE base (rope_local_base_freq), its full
  layers rope_theta and its scaling;
- the MLP's gate through GELU (tanh), and the logits soft-capped when
  final_logit_softcapping is set (Gemma 2's 30).

On a CPU the projections run from the C kernel's packed panels like the Llama family's; the
norms and RoPE stay in torch (the fused kernels are Llama's: weight, not 1 + weight).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..kernels import cpu_linear
from ..parallel import TP
from .llama import MLP, Attention, Embedding, Linear, RMSNorm, linear
from .rope import RotaryEmbedding

if TYPE_CHECKING:
    from .config import ModelConfig


class GemmaRMSNorm(RMSNorm):
    """Never fused with a residual add: Gemma norms each sublayer's output before adding it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class GemmaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TP):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Attention(cfg, layer_idx, norm=GemmaRMSNorm, tp=tp)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = MLP(cfg, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, h: torch.Tensor, rope: tuple, fb) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rope, fb))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaLM(nn.Module):
    """Parameter names are HF's without the leading "model.", q/k/v and gate/up fused as the
    Llama family's (loader.py); split over ranks as theirs (`tp`)."""

    def __init__(self, cfg: ModelConfig, device=None, tp: TP = TP()):
        super().__init__()
        self.cfg = cfg
        g = cfg.gemma
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_context, cfg.rope_theta, cfg.rope_scaling,
                                    device=device)
        self.local_rope = RotaryEmbedding(cfg.head_dim, cfg.max_context, g.local_rope_theta, None,
                                          device=device)
        self.local = [bool(cfg.windows and cfg.windows[i]) for i in range(cfg.num_layers)]
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(GemmaLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, self.embed_tokens.num_embeddings, bias=False)
        self.tied_head: cpu_linear.Panels | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        return self.decode(h * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=h.dtype), positions, fb)

    def decode(self, h: torch.Tensor, positions: torch.Tensor, fb) -> torch.Tensor:
        ropes = self.rope(positions, h.dtype), self.local_rope(positions, h.dtype)
        for layer, local in zip(self.layers, self.local):
            h = layer(h, ropes[local], fb)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.cfg.tie_word_embeddings:
            out = linear(hidden, self.embed_tokens.weight, None, self.tied_head)
        else:
            out = self.lm_head(hidden)
        out = self.embed_tokens.gather(out, self.cfg.vocab_size)
        cap = self.cfg.gemma.final_logit_softcapping
        if cap is not None:
            out = torch.tanh(out / cap) * cap
        return out.float()

    def pack_weights(self, fuse_mlp: bool = True, dot: bool = False) -> None:
        """Every projection from the C kernel's panels (llama.py's CausalLM.pack_weights; the
        GELU MLP keeps gate and up one product)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack(dot)
        if self.cfg.tie_word_embeddings:
            self.tied_head = cpu_linear.pack(self.embed_tokens.weight)
