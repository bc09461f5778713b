"""Rotary position embedding, "rotate_half" layout, with a cos/sin cache up to max_context.

Inverse frequencies are computed exactly as transformers does for the supported rope types, so
cos/sin match HF bit for bit in fp32; they are cast to q's dtype before use, as HF does.
M-RoPE (Qwen2-VL) takes three position rows (t, h, w) and gives each frequency section the
angle of its row; with equal rows it is plain RoPE, so text-only batches pass one row.
"""
from __future__ import annotations

import math

import torch
from torch import nn

# "factors": per-frequency divisors given as a list, as llama.cpp stores Llama 3.1+ scaling in
# GGUF files (gguf.py); the others are HF's.
ROPE_TYPES = ("default", "linear", "llama3", "factors")


def inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies for the given HF rope parameters."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r} "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    # On the CPU whatever the default device is (the loader builds modules on "meta"), as HF does.
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    freq = 1.0 / (theta ** exps)
    if rope_type == "linear":
        return freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3(freq, scaling)
    if rope_type == "factors":
        return freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    return freq


def _llama3(freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freq
    out = torch.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, out)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_context: int, theta: float, scaling: dict | None,
                 device=None, mrope_section: tuple[int, ...] | None = None):
        super().__init__()
        freq = inv_freq(head_dim, theta, scaling).to(device)
        t = torch.arange(max_context, dtype=torch.int64, device=device).float()
        angles = t[:, None] * freq[None, :]  # [max_context, head_dim // 2], fp32 as HF
        # Not part of the checkpoint: rebuilt at load time, never saved.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        # M-RoPE: frequency j takes its angle from position row rows[j] (t, h, w, t, ...: the
        # sections in turn, HF's non-interleaved layout).
        rows = None
        if mrope_section is not None:
            rows = torch.tensor([i % 3 for i, n in enumerate(mrope_section) for _ in range(n)],
                                device=device)
        self.register_buffer("rows", rows, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [T], or [3, T] (t, h, w) with mrope_section -> (cos, sin), each
        [T, 1, head_dim // 2] in `dtype` (HF casts to q's)."""
        if positions.dim() == 1:
            cos, sin = self.cos[positions], self.sin[positions]
        else:
            idx = positions[self.rows].T  # [T, head_dim // 2]: each frequency's own row
            cols = torch.arange(idx.shape[1], device=idx.device)
            cos, sin = self.cos[idx, cols], self.sin[idx, cols]
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, H, D], k [T, Hkv, D] -> rotated (q, k)."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same arithmetic as HF's x * cat(cos, cos) + rotate_half(x) * cat(sin, sin).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
