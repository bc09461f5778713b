"""Rotary position embedding, "rotate_half" layout, with a cos/sin cache up to max_context.

Inverse frequencies are computed exactly as transformers does for the supported rope types, so
cos/sin match HF bit for bit in fp32; they are cast to q's dtype before use, as HF does.
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
                 device=None):
        super().__init__()
        freq = inv_freq(head_dim, theta, scaling).to(device)
        t = torch.arange(max_context, dtype=torch.int64, device=device).float()
        angles = t[:, None] * freq[None, :]  # [max_context, head_dim // 2], fp32 as HF
        # Not part of the checkpoint: rebuilt at load time, never saved.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [T] -> (cos, sin), each [T, 1, head_dim // 2] in `dtype` (HF casts to q's)."""
        return (self.cos[positions].to(dtype)[:, None, :],
                self.sin[positions].to(dtype)[:, None, :])


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, H, D], k [T, Hkv, D] -> rotated (q, k)."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same arithmetic as HF's x * cat(cos, cos) + rotate_half(x) * cat(sin, sin).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
