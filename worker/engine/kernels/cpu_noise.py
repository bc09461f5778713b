"""The sampler's seeded noise on a CPU (cpu_noise.c), built and loaded by cpu_build.py: the
uniforms, and a whole row's Gumbel-max draw.

Why C: a sampled row with no top-k / top-p draws over the whole vocabulary, so its noise is a
hash of every (seed, step, token). In torch that is some twenty int32 passes over [B, V]; at
batch 64 on SmolLM2's 49,152 tokens, ~16 ms of a ~113 ms decode step. The C loop hashes each
value once, in registers, to the same bits. The draw over the whole vocabulary (no top-k /
top-p) then took the uniforms' two logs, a subtraction and an argmax in as many more passes:
0.24 ms a row and 1.2 ms at batch 8 on SmolLM2's rows at T = 0.8; gumbel_argmax takes 0.09 and
0.38, scoring only the values a bound cannot rule out.
"""
from __future__ import annotations

import torch

from . import cpu_build
from .cpu_build import I64, P

_fns: dict[str, object] = {}


def load() -> bool:
    """Whether the kernel is here (built, or built now); False where it cannot be built."""
    return cpu_build.functions("cpu_noise", _fns, {"uniform": ("fanout_seeded_uniform", [P, I64, P, I64, P]),
                                                   "at": ("fanout_uniform_at", [P, I64, P, I64, P, I64, P], I64),
                                                   "draw": ("fanout_gumbel_argmax", [P, I64, I64, I64, P, P, P], I64)})


def _keys(row_keys: torch.Tensor, col_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    row_keys, col_keys = row_keys.contiguous(), col_keys.contiguous()
    if row_keys.dtype != torch.int64 or col_keys.dtype != torch.int64:
        raise ValueError(f"cpu_noise: keys must be int64, got {row_keys.dtype}, {col_keys.dtype}")
    return row_keys, col_keys


def seeded_uniform(row_keys: torch.Tensor, col_keys: torch.Tensor) -> torch.Tensor:
    """[B, V] float32 from row_keys [B] and col_keys [V] (int64 CPU tensors holding 32-bit
    keys; call load() first)."""
    row_keys, col_keys = _keys(row_keys, col_keys)
    out = torch.empty(row_keys.shape[0], col_keys.shape[0], dtype=torch.float32)
    _fns["uniform"](row_keys.data_ptr(), row_keys.shape[0], col_keys.data_ptr(),
                    col_keys.shape[0], out.data_ptr())
    return out


def uniform_at(row_keys: torch.Tensor, cols: torch.Tensor, col_keys: torch.Tensor) -> torch.Tensor:
    """seeded_uniform's values at columns cols ([B, K] int64) only: [B, K] float32."""
    row_keys, col_keys = _keys(row_keys, col_keys)
    cols = cols.contiguous()
    if cols.dtype != torch.int64 or cols.dim() != 2 or cols.shape[0] != row_keys.shape[0]:
        raise ValueError(f"cpu_noise.uniform_at: cols must be [{row_keys.shape[0]}, K] int64, got "
                         f"{tuple(cols.shape)} {cols.dtype}")
    out = torch.empty(cols.shape, dtype=torch.float32)
    bad = _fns["at"](row_keys.data_ptr(), cols.shape[0], cols.data_ptr(), cols.shape[1], col_keys.data_ptr(),
                     col_keys.shape[0], out.data_ptr())
    if bad:
        raise IndexError(f"cpu_noise.uniform_at: column {cols.flatten()[bad - 1].item()} outside "
                         f"the vocabulary of {col_keys.shape[0]}")
    return out


def gumbel_argmax(z: torch.Tensor, row_keys: torch.Tensor, col_keys: torch.Tensor) -> torch.Tensor:
    """[B] int64: each row's argmax of z - log(-log u), u = seeded_uniform(row_keys, col_keys),
    z [B, V] float32 rows (its columns contiguous), V = len(col_keys); the first of equal
    scores, a NaN the largest. Its log is C's own (within an ulp of torch's), so a score may
    differ from the torch ops' by an ulp: a row whose two best scores lie that close may draw
    the other (call load() first)."""
    row_keys, col_keys = _keys(row_keys, col_keys)
    if (z.dtype != torch.float32 or z.dim() != 2 or z.stride(1) != 1 or not col_keys.shape[0]
            or z.shape != (row_keys.shape[0], col_keys.shape[0])):
        raise ValueError(f"cpu_noise.gumbel_argmax: expected [{row_keys.shape[0]}, {col_keys.shape[0]}] float32 "
                         f"rows, got {tuple(z.shape)} {z.dtype} strides {tuple(z.stride())}")
    idx = torch.empty(z.shape[0], dtype=torch.int64)
    if _fns["draw"](z.data_ptr(), z.shape[0], z.shape[1], z.stride(0), row_keys.data_ptr(), col_keys.data_ptr(),
                    idx.data_ptr()):
        raise MemoryError(f"cpu_noise.gumbel_argmax: no memory for the scratch of {z.shape[0]} rows")
    return idx
