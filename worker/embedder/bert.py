"""The BERT encoder (BertModel's layers, in eval: no dropout), over a padded batch.

Post-norm layers: x = LN(x + attn(x)); x = LN(x + FFN(x)) with exact GELU. Query, key and
value are one matrix product. Rows of a batch have similar lengths (the embedder groups
them so): padding keys are masked out, and a batch without padding is not masked at all.

`dtype` is the matrix products' (their weights and inputs); the residual stream, layer
norms, biases and attention stay float32 whatever it is. bfloat16 products on a CPU with
AVX512-BF16 run ~1.45x float32's, vectors within cosine 0.99995 of float32's on MiniLM
(bench/embed.py); in full bfloat16 they drifted to 0.99987.

On a CPU, float32 products run through oneDNN from weights reordered once for it, the FFN's
GELU fused into its first product (`Proj`): a [2048, 384] x [384, 1536] product with its
GELU took 11.7 ms against 21.2 for F.linear then F.gelu (MKL), on the 2-core AMD EPYC
(AVX-512) of bench/embed.py; the outputs differ by float32 rounding (1e-4 on values ~20).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def _onednn(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's reordered-weight products: float32 on a CPU where torch has them (its own
    operators, which torch.compile uses on a CPU)."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Proj:
    """One matrix product and its bias: x @ w.T + b, the product in w's dtype, the result
    float32; `gelu` fuses the activation after it."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor, onednn: bool, rows: int):
        self.b = b
        self.w = torch.ops.mkldnn._reorder_linear_weight(w, rows) if onednn else w
        self.onednn = onednn

    def __call__(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.w, self.b, "gelu" if gelu else "none", [],
                                                      "none" if gelu else "")
        if self.w.dtype == torch.float32:
            y = F.linear(x, self.w, self.b)
        else:
            y = F.linear(x.to(self.w.dtype), self.w).float() + self.b
        return F.gelu(y) if gelu else y


class Bert:
    def __init__(self, config: dict, weights: dict[str, torch.Tensor], device, dtype, rows: int = 2048):
        """`rows`: the tokens of a typical batch (oneDNN orders the weights for it)."""
        if config.get("model_type") != "bert" or config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"model_type {config.get('model_type')!r} is not supported as an embedding "
                             f"encoder (taken: bert with absolute positions)")
        if config.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (taken: gelu)")
        w = {k.removeprefix("bert."): v for k, v in weights.items()}
        device = torch.device(device)
        onednn = _onednn(device, dtype)

        def t(name):  # float32: embeddings, norms, biases
            return w[name].to(device=device, dtype=torch.float32)

        def proj(weight: torch.Tensor, bias: torch.Tensor) -> Proj:
            return Proj(weight.to(device=device, dtype=dtype), bias, onednn, rows)

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
            qkv = proj(torch.cat([w[a + f"self.{n}.weight"] for n in ("query", "key", "value")]),
                       torch.cat([t(a + f"self.{n}.bias") for n in ("query", "key", "value")]))
            self.layers.append((qkv, proj(w[a + "output.dense.weight"], t(a + "output.dense.bias")),
                                (t(a + "output.LayerNorm.weight"), t(a + "output.LayerNorm.bias")),
                                proj(w[p + "intermediate.dense.weight"], t(p + "intermediate.dense.bias")),
                                proj(w[p + "output.dense.weight"], t(p + "output.dense.bias")),
                                (t(p + "output.LayerNorm.weight"), t(p + "output.LayerNorm.bias"))))

    @classmethod
    def load(cls, path: str, config: dict, device, dtype, rows: int = 2048) -> "Bert":
        import glob
        import os
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"{path}: no .safetensors weights")
        weights = {}
        for f in files:
            weights.update(load_file(f))
        return cls(config, weights, device, dtype, rows)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """ids [B, L] -> hidden states [B, L, H] float32; mask [B, L] bool (True: a real
        token) or None when no row is padded."""
        B, L = ids.shape
        H, nh = self.hidden, self.heads
        x = self.word[ids] + self.pos[:L] + self.type0
        x = F.layer_norm(x, (H,), *self.ln0, self.eps)
        bias = None
        if mask is not None:  # keys that are padding get -inf
            bias = torch.zeros(B, 1, 1, L, dtype=x.dtype, device=x.device).masked_fill(~mask[:, None, None, :],
                                                                                      float("-inf"))
        for qkv, o, ln1, up, down, ln2 in self.layers:
            q, k, v = qkv(x).view(B, L, 3, nh, H // nh).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            x = F.layer_norm(x + o(a.transpose(1, 2).reshape(B, L, H)), (H,), *ln1, self.eps)
            x = F.layer_norm(x + down(up(x, gelu=True)), (H,), *ln2, self.eps)
        return x
