"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): Qwen2-VL (qwen2_vl.py) with another vision
encoder. Its blocks use RMSNorm and a gated MLP, and most attend only within square windows of
tokens (window_size pixels a side); the blocks of full_blocks attend over the whole image.

So that each window is one run of rows for the attention, the patches are put in window order
(window after window in row order, each window's tokens in row order, a token's patches
together) after the patch embedding, and the merged tokens back in image order after the
merger, as transformers does. The language model, its M-RoPE and the image preprocessing are
Qwen2-VL's (for images, which are all this engine takes; video would differ).
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
from torch import nn

from .llama import ACTIVATIONS, RMSNorm
from .qwen2_vl import Qwen2VL, VisionTower

if TYPE_CHECKING:
    from .config import Qwen2_5_VLVisionConfig


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), each projection with a bias. Three matmuls, as transformers
    runs them: llama.py's MLP fuses gate and up, which rounds differently."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class WindowVisionTower(VisionTower):
    norm = RMSNorm

    def mlp(self, v: Qwen2_5_VLVisionConfig) -> nn.Module:
        return GatedMLP(v.embed_dim, v.intermediate_size, v.hidden_act)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        order, windows = self.windows(grids)
        order = order.to(pixels.device)
        unit = self.v.merge_size ** 2

        def by_window(rows: torch.Tensor) -> torch.Tensor:
            return rows.view(-1, unit, *rows.shape[1:])[order].flatten(0, 1)

        # Windows never cross images, so an image is still one run in window order.
        images = self.image_lens(grids)
        lens = [images if i in self.v.full_blocks else windows for i in range(len(self.blocks))]
        rope = tuple(by_window(r) for r in self.rope(grids, pixels.device))
        return self.encode(by_window(self.patch_embed(pixels)), rope, lens)[order.argsort()]

    def windows(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """The tokens of all images (numbered in image order) in window order, and each
        window's patch count. Windows at the right and bottom edges may be cut short."""
        side = self.v.window_size // (self.v.patch_size * self.v.merge_size)  # in tokens
        order, lens, first = [], [], 0
        for t, h, w in grids:
            frames = torch.arange(first, first + t * h * w).view(t, h, w)
            first += t * h * w
            for frame, r, c in itertools.product(frames, range(0, h, side), range(0, w, side)):
                window = frame[r:r + side, c:c + side].flatten()
                order.append(window)
                lens.append(window.numel() * self.v.merge_size ** 2)
        return torch.cat(order), lens


class Qwen2_5_VL(Qwen2VL):
    tower = WindowVisionTower
