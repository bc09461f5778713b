"""The BERT encoder (BertModel's layers, in eval: no dropout), over a padded batch.

Post-norm layers: x = LN(x + attn(x)); x = LN(x + FFN(x)) with exact GELU. Query, key and
value are one matrix product. Rows of a batch have similar lengths (the embedder groups
them so): padding keys are masked out, and a batch without padding is not masked at all.

`dtype` is the matrix products' (their weights and inputs); the residual stream, layer
norms, biases and attention stay float32 whatever it is. bfloat16 products on a CPU with
AVX512-BF16 run ~1.45x float32's, vectors within cosine 0.99995 of float32's on MiniLM
(bench/embed.py); in full bfloat16 they drifted to 0.99987.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class Bert:
    def __init__(self, config: dict, weights: dict[str, torch.Tensor], device, dtype):
        if config.get("model_type") != "bert" or config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"model_type {config.get('model_type')!r} is not supported as an embedding "
                             f"encoder (taken: bert with absolute positions)")
        if config.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (taken: gelu)")
        w = {k.removeprefix("bert."): v for k, v in weights.items()}

        def t(name, mm=False):  # mm: a matrix product's weight, in `dtype`; the rest float32
            return w[name].to(device=device, dtype=dtype if mm else torch.float32)

        self.heads = config["num_attention_heads"]
        self.eps = config.get("layer_norm_eps", 1e-12)
        self.hidden = config["hidden_size"]
        e = "embeddings."
        self.word, self.pos, self.type0 = t(e + "word_embeddings.weight"), t(e + "position_embeddings.weight"), \
            t(e + "token_type_embeddings.weight")[0]
        self.ln0 = (t(e + "LayerNorm.weight"), t(e + "LayerNorm.bias"))
        self.layers = []
        for i in range(config["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            a = p + "attention."
            qkv_w = torch.cat([t(a + f"self.{n}.weight", True) for n in ("query", "key", "value")])
            qkv_b = torch.cat([t(a + f"self.{n}.bias") for n in ("query", "key", "value")])
            self.layers.append((qkv_w, qkv_b, t(a + "output.dense.weight", True), t(a + "output.dense.bias"),
                                t(a + "output.LayerNorm.weight"), t(a + "output.LayerNorm.bias"),
                                t(p + "intermediate.dense.weight", True), t(p + "intermediate.dense.bias"),
                                t(p + "output.dense.weight", True), t(p + "output.dense.bias"),
                                t(p + "output.LayerNorm.weight"), t(p + "output.LayerNorm.bias")))

    @classmethod
    def load(cls, path: str, config: dict, device, dtype) -> "Bert":
        import glob
        import os
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"{path}: no .safetensors weights")
        weights = {}
        for f in files:
            weights.update(load_file(f))
        return cls(config, weights, device, dtype)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """ids [B, L] -> hidden states [B, L, H]; mask [B, L] bool (True: a real token) or
        None when no row is padded."""
        B, L = ids.shape
        H, nh = self.hidden, self.heads
        x = self.word[ids] + self.pos[:L] + self.type0  # float32
        x = F.layer_norm(x, (H,), *self.ln0, self.eps)
        bias = None
        if mask is not None:  # keys that are padding get -inf
            bias = torch.zeros(B, 1, 1, L, dtype=x.dtype, device=x.device).masked_fill(~mask[:, None, None, :],
                                                                                      float("-inf"))
        for qkv_w, qkv_b, o_w, o_b, ln1_w, ln1_b, up_w, up_b, down_w, down_b, ln2_w, ln2_b in self.layers:
            q, k, v = _linear(x, qkv_w, qkv_b).view(B, L, 3, nh, H // nh).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            x = F.layer_norm(x + _linear(a.transpose(1, 2).reshape(B, L, H), o_w, o_b), (H,), ln1_w, ln1_b, self.eps)
            h = F.gelu(_linear(x, up_w, up_b))
            x = F.layer_norm(x + _linear(h, down_w, down_b), (H,), ln2_w, ln2_b, self.eps)
        return x


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x @ w.T + b, the product in w's dtype, the result float32 (module doc)."""
    if w.dtype == torch.float32:
        return F.linear(x, w, b)
    return F.linear(x.to(w.dtype), w).float() + b
