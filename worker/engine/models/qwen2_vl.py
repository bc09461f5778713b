"""Qwen2-VL (Qwen2VLForConditionalGeneration): a vision transformer over patches of two frames,
with 2D rotary attention within each image, a merger of merge_size**2 neighbouring patches
into one token, and a Qwen2 language model (llama.py) with M-RoPE over the paged KV cache.

An image arrives as rows of flattened patches, the patches of one token next to each other,
and the grid of its tokens (images.py); its tokens' three M-RoPE position rows come with the
batch (req.py). Parameter names are the checkpoint's after the loader's renames (registry.py):
`visual.*` (HF's), `language_model.*` (CausalLM's). Qwen2.5-VL (qwen2_5_vl.py) is built
from these pieces.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .llama import CausalLM
from .llava import VisionLM, VisionMLP
from .rope import apply_rotary

if TYPE_CHECKING:
    from ..images import Image
    from .config import ModelConfig, Qwen2VLVisionConfig


def repeat_frames(patches: torch.Tensor, frames: int) -> torch.Tensor:
    """Qwen2-VL patches [N, 3 * p * p] kept once -> [N, 3 * frames * p * p], each repeated over
    the frames, as transformers' pixel_values hold them (and the patch embedding takes them)."""
    n = patches.shape[0]
    return patches.view(n, 3, 1, -1).expand(n, 3, frames, -1).reshape(n, -1)


class PatchEmbed(nn.Module):
    def __init__(self, v: Qwen2VLVisionConfig):
        super().__init__()
        self.kernel = (v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        self.proj = nn.Conv3d(v.in_channels, v.embed_dim, self.kernel[1:], stride=self.kernel[1:],
                              bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, C * p * p], an image's patches (one frame) -> [N, embed_dim]."""
        # An image is its frames' one picture repeated (as transformers feeds it), so it is kept
        # once (images.py) and repeated here. One kernel per patch: a matmul on the flattened
        # patch would do, but the convolution rounds as transformers' does (a matmul differs in
        # the last bits, which the LM grows).
        return self.proj(repeat_frames(x, self.kernel[1]).view(-1, *self.kernel)).flatten(1)


class VisionAttention(nn.Module):
    def __init__(self, v: Qwen2VLVisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = v.num_heads, v.embed_dim // v.num_heads
        self.qkv = nn.Linear(v.embed_dim, 3 * v.embed_dim)
        self.proj = nn.Linear(v.embed_dim, v.embed_dim)

    def forward(self, x: torch.Tensor, rope: tuple, lens: list[int]) -> torch.Tensor:
        N, D = x.shape
        q, k, v = self.qkv(x).view(N, 3, self.num_heads, self.head_dim).unbind(1)
        # Rotated in fp32 whatever the model dtype, as HF does.
        q, k = (t.to(x.dtype) for t in apply_rotary(q.float(), k.float(), *rope))
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, N, head_dim]
        # Within each image only. 4D, as transformers calls it: the CPU kernel then rounds alike.
        parts = zip(q.split(lens, 2), k.split(lens, 2), v.split(lens, 2))
        o = torch.cat([F.scaled_dot_product_attention(*p) for p in parts], dim=2)
        return self.proj(o[0].transpose(0, 1).reshape(N, D))


class VisionBlock(nn.Module):
    def __init__(self, v: Qwen2VLVisionConfig, norm: type[nn.Module], mlp: nn.Module):
        super().__init__()
        self.norm1 = norm(v.embed_dim, 1e-6)
        self.attn = VisionAttention(v)
        self.norm2 = norm(v.embed_dim, 1e-6)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rope: tuple, lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, lens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, v: Qwen2VLVisionConfig, norm: type[nn.Module]):
        super().__init__()
        self.width = v.embed_dim * v.merge_size ** 2
        self.ln_q = norm(v.embed_dim, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, v.out_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, embed_dim], a token's patches adjacent -> [N / merge_size**2, out_size]."""
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTower(nn.Module):
    norm: type[nn.Module] = nn.LayerNorm  # of the blocks and the merger

    def __init__(self, v: Qwen2VLVisionConfig):
        super().__init__()
        self.v = v
        self.patch_embed = PatchEmbed(v)
        self.blocks = nn.ModuleList(VisionBlock(v, self.norm, self.mlp(v)) for _ in range(v.depth))
        self.merger = PatchMerger(v, self.norm)

    def mlp(self, v: Qwen2VLVisionConfig) -> nn.Module:
        return VisionMLP(v.embed_dim, v.intermediate_size, v.hidden_act)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels [N, C * frames * p * p] of images whose token grids are `grids` -> their
        tokens' features [N / merge_size**2, out_size]."""
        lens = self.image_lens(grids)
        rope = self.rope(grids, pixels.device)
        return self.encode(self.patch_embed(pixels), rope, [lens] * len(self.blocks))

    def encode(self, x: torch.Tensor, rope: tuple, lens: list[list[int]]) -> torch.Tensor:
        """The blocks, each attending within runs of lens[block] patches, then the merger."""
        for block, runs in zip(self.blocks, lens):
            x = block(x, rope, runs)
        return self.merger(x)

    def image_lens(self, grids: list[tuple[int, int, int]]) -> list[int]:
        """Each image's patch count."""
        return [t * h * w * self.v.merge_size ** 2 for t, h, w in grids]

    def rope(self, grids: list[tuple[int, int, int]], device) -> tuple:
        """(cos, sin) [N, 1, head_dim // 2] of each patch: the first half of the frequencies
        turns with its row, the second with its column (in patches)."""
        m, dim = self.v.merge_size, self.v.embed_dim // self.v.num_heads // 2
        exps = torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim
        freq = 1.0 / self.v.rope_theta ** exps
        pos = []
        for t, h, w in grids:
            # Patches come token by token, each token's m x m patches in row order.
            rows = torch.arange(h * m, device=device).view(h, 1, m, 1).expand(h, w, m, m)
            cols = torch.arange(w * m, device=device).view(1, w, 1, m).expand(h, w, m, m)
            pos.append(torch.stack([rows.flatten(), cols.flatten()], -1).repeat(t, 1))
        angles = (torch.cat(pos).float()[..., None] * freq).flatten(1)  # [N, dim]: rows, cols
        return angles.cos()[:, None, :], angles.sin()[:, None, :]


class Qwen2VL(VisionLM):
    tower = VisionTower  # Qwen2.5-VL's: qwen2_5_vl.py

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.cfg = cfg
        self.visual = self.tower(cfg.vision)
        self.language_model = CausalLM(cfg, device=device)

    def image_features(self, images: list[Image]) -> torch.Tensor:
        """Images (their patch rows and token grids) -> features [sum of tokens, hidden]."""
        w = self.visual.patch_embed.proj.weight
        pixels = torch.cat([im.pixels for im in images]).to(w.device, w.dtype)
        return self.visual(pixels, [im.grid for im in images])
