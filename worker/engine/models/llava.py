"""LLaVA (LlavaForConditionalGeneration): a CLIP vision tower, a two-layer projector and a
Llama language model (llama.py) over the paged KV cache.

An image's tokens are pad ids in the prompt (images.py); during prefill the batch carries
each distinct image once (`fb.images`), whose projected features replace the embeddings at
those rows. Parameter names are the checkpoint's after the loader's renames (registry.py):
`vision_tower.*` (CLIPVisionModel's without `vision_model.`), `multi_modal_projector.*`,
`language_model.*` (CausalLM's). Only the vision layers up to `vision_feature_layer` are built.
`VisionLM` (the splice of image features into the embeddings) and `VisionMLP` serve
qwen2_vl.py too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .llama import ACTIVATIONS, CausalLM

if TYPE_CHECKING:
    from ..images import Image
    from .config import ModelConfig, VisionConfig

class ClipAttention(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = v.num_heads, v.hidden_size // v.num_heads
        self.q_proj = nn.Linear(v.hidden_size, v.hidden_size)
        self.k_proj = nn.Linear(v.hidden_size, v.hidden_size)
        self.v_proj = nn.Linear(v.hidden_size, v.hidden_size)
        self.out_proj = nn.Linear(v.hidden_size, v.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        q, k, v = (p(x).view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(o.transpose(1, 2).reshape(B, N, D))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipLayer(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.self_attn = ClipAttention(v)
        self.layer_norm2 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.mlp = VisionMLP(v.hidden_size, v.intermediate_size, v.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEmbeddings(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(v.hidden_size))
        self.patch_embedding = nn.Conv2d(v.num_channels, v.hidden_size, v.patch_size,
                                         stride=v.patch_size, bias=False)
        self.position_embedding = nn.Embedding(v.num_patches + 1, v.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [B, P, D]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipVisionTower(nn.Module):
    def __init__(self, v: VisionConfig):
        super().__init__()
        self.embeddings = ClipEmbeddings(v)
        self.pre_layrnorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)  # HF's spelling
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(ClipLayer(v) for _ in range(v.layers_used))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, H, W] -> the hidden states of layer vision_feature_layer [B, 1 + P, D]."""
        x = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.encoder.layers:
            x = layer(x)
        return x


class Projector(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.linear_1 = nn.Linear(v.hidden_size, cfg.hidden_size, bias=v.projector_bias)
        self.linear_2 = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=v.projector_bias)
        self.act = ACTIVATIONS[v.projector_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class VisionLM(nn.Module):
    """A language model (`language_model`: llama.py's CausalLM) whose prompts hold images. A
    subclass builds its vision tower and gives `image_features(images)`: the distinct images
    of a batch (images.py's Image) -> their features, concatenated [sum of tokens, hidden]."""

    def __init__(self):
        super().__init__()
        # pad id -> features of an image that the last prefill chunk cut: the next chunk,
        # which holds the rest of its tokens, takes them instead of running the tower again.
        self.carried: dict[int, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb) -> torch.Tensor:
        lm = self.language_model
        # Image positions hold pad ids past the vocabulary; their embeddings are replaced.
        h = lm.embed_tokens(input_ids.masked_fill(input_ids >= self.cfg.vocab_size, 0))
        if fb.images is not None:
            h[fb.images.rows] = self.features(fb.images)[fb.images.features]
        return lm.decode(h, positions, fb)

    def features(self, batch) -> torch.Tensor:
        """The features of the batch's images (batch.py's ImageBatch), concatenated: the
        tower runs on those not carried over from the last chunk, in one call."""
        todo = [im for im in batch.images if im.pad not in self.carried]
        fresh = iter(self.image_features(todo).split([im.tokens for im in todo]) if todo else ())
        per = [self.carried[im.pad] if im.pad in self.carried else next(fresh) for im in batch.images]
        self.carried = {im.pad: f for im, f in zip(batch.images, per) if im.pad in batch.cut}
        return torch.cat(per)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.logits(hidden)

    def pack_weights(self, dot: bool = False) -> None:
        self.language_model.pack_weights(dot=dot)  # the vision tower runs once per image: left dense


class LlavaLM(VisionLM):
    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = ClipVisionTower(cfg.vision)
        self.multi_modal_projector = Projector(cfg)
        self.language_model = CausalLM(cfg, device=device)

    def image_features(self, images: list[Image]) -> torch.Tensor:
        """K images [3, H, W] -> projected features [K * tokens_per_image, hidden]."""
        w = self.vision_tower.embeddings.patch_embedding.weight
        x = self.vision_tower(torch.stack([im.pixels for im in images]).to(w.device, w.dtype))
        if self.cfg.vision.select_strategy == "default":
            x = x[:, 1:]  # drop CLS
        return self.multi_modal_projector(x).flatten(0, 1)
