"""The sampler's seeded uniforms on a CPU (cpu_noise.c), built and loaded by cpu_build.py.

Why C: a sampled row with no top-k / top-p draws over the whole vocabulary, so its noise is a
hash of every (seed, step, token). In torch that is some twenty int32 passes over [B, V]; at
batch 64 on SmolLM2's 49,152 tokens, ~16 ms of a ~113 ms decode step. The C loop hashes each
value once, in registers, to the same bits.
"""
from __future__ import annotations

import torch

from . import cpu_build
from .cpu_build import I64, P

_fns: dict[str, object] = {}


def load() -> bool:
    """Whether the kernel is here (built, or built now); False where it cannot be built."""
    return cpu_build.functions("cpu_noise", _fns, {"uniform": ("fanout_seeded_uniform", [P, I64, P, I64, P])})


def seeded_uniform(row_keys: torch.Tensor, col_keys: torch.Tensor) -> torch.Tensor:
    """[B, V] float32 from row_keys [B] and col_keys [V] (int64 CPU tensors holding 32-bit
    keys; call load() first)."""
    row_keys, col_keys = row_keys.contiguous(), col_keys.contiguous()
    if row_keys.dtype != torch.int64 or col_keys.dtype != torch.int64:
        raise ValueError(f"cpu_noise: keys must be int64, got {row_keys.dtype}, {col_keys.dtype}")
    out = torch.empty(row_keys.shape[0], col_keys.shape[0], dtype=torch.float32)
    _fns["uniform"](row_keys.data_ptr(), row_keys.shape[0], col_keys.data_ptr(),
                    col_keys.shape[0], out.data_ptr())
    return out
