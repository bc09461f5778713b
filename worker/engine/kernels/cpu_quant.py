"""The CPU matmul from quantized weights (cpu_quant.c), built and loaded by cpu_build.py: a
GGUF file's Q4_0, Q4_1, Q4_K and Q8_0 weights kept as their codes in memory and
dequantized a piece at a time in the kernel.

Why: a decode step reads every weight of the model, so at small batches its time is the
weights' bytes over the memory's bandwidth. In fp32 SmolLM2-135M is 540 MB; its Q4_1 file's
codes and scales here are ~98 MB (Q4_1: 20 bytes per 32 weights, its scale and offset kept as
the file's float16s; Q8_0: 36, its offset 0 kept too). The weights the kernel computes are gguf's dequantization's to the bit, so
the engine's outputs equal the fp32 path's on the same file (tests/test_quant.py).

`Quantized` is a weight as read from the file, row by row (the loader permutes and joins
rows); `pack` lays it out in the kernel's panels (`QPanels`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import cpu_build
from .cpu_build import I64, P
from .cpu_linear import matmul_input

# GGUF's block types kept quantized -> their kind here (how codes become weights: Quantized).
KINDS = {"Q4_1": 0, "Q4_K": 0, "Q4_0": 1, "Q8_0": 2}
GROUP = 32  # weights per scale


@dataclass(slots=True)
class Quantized:
    """W[r, k] = d[r, k // 32] * q[r, k] (+ m[r, k // 32]; Q4_0: (q - 8) * d) with each
    product and sum rounded as gguf's numpy does."""
    kind: int  # KINDS' values
    q: torch.Tensor  # uint8 [n, k] codes (0..15, or int8's bytes for Q8_0)
    d: torch.Tensor  # float32 [n, k / 32]
    m: torch.Tensor | None  # float32 [n, k / 32] (kind 0), else None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def bits(self) -> int:
        return 8 if self.kind == 2 else 4

    @property
    def nbytes(self) -> int:
        """Its size in the kernel's panels (4-bit codes two to a byte; a scale and an offset
        per 32 weights, float16 where they are exactly float16s)."""
        return self.q.numel() * self.bits // 8 + (4 if self.half else 8) * self.d.numel()

    @property
    def half(self) -> bool:
        """Whether its scales and offsets are all float16 numbers (the file's, for Q4_0,
        Q4_1 and Q8_0; not Q4_K's products): the panels then hold them in half the bytes."""
        return all(bool((s.half().float() == s).all()) for s in (self.d, self.offset()))

    def offset(self) -> torch.Tensor:
        """o in the kernel's weight q * d + o (cpu_quant.c): exact."""
        return {0: self.m, 1: -8 * self.d, 2: torch.zeros_like(self.d)}[self.kind]

    def rows(self, index: torch.Tensor) -> Quantized:
        return Quantized(self.kind, self.q[index], self.d[index], None if self.m is None else self.m[index])

    @staticmethod
    def cat(parts: list[Quantized]) -> Quantized:
        """Row blocks of one kind stacked (a fused projection's parts)."""
        if len({p.kind for p in parts}) != 1:
            raise ValueError("cpu_quant: weights of different kinds cannot be joined")
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return Quantized(parts[0].kind, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m)

    def dequantize(self) -> torch.Tensor:
        """float32 [n, k], as gguf.quants.dequantize makes it."""
        d = self.d.repeat_interleave(GROUP, dim=1)
        if self.kind == 2:
            return self.q.view(torch.int8).float() * d
        if self.kind == 1:
            return (self.q.float() - 8) * d
        return self.q.float() * d + self.m.repeat_interleave(GROUP, dim=1)


def from_blocks(type_name: str, data: np.ndarray, n: int, k: int) -> Quantized:
    """A GGUF tensor's raw blocks (its rows' bytes, [n, bytes]) -> Quantized."""
    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, -1)

    def f16(cols: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(cols).view(np.float16).astype(np.float32)

    def nibbles(qs: np.ndarray) -> np.ndarray:  # [n, blocks, 16] -> [n, blocks, 32]: low halves, then high
        return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)

    if type_name == "Q8_0":
        blocks = b.reshape(n, k // 32, 34)
        return _quantized(2, blocks[..., 2:].reshape(n, k), f16(blocks[..., :2]).reshape(n, -1), None)
    if type_name in ("Q4_0", "Q4_1"):
        head = 2 if type_name == "Q4_0" else 4
        blocks = b.reshape(n, k // 32, head + 16)
        q = nibbles(blocks[..., head:]).reshape(n, k)
        d = f16(blocks[..., :2]).reshape(n, -1)
        m = None if type_name == "Q4_0" else f16(blocks[..., 2:4]).reshape(n, -1)
        return _quantized(KINDS[type_name], q, d, m)
    if type_name == "Q4_K":
        from gguf.quants import Q4_K
        blocks = b.reshape(n * (k // 256), 144)
        d, dmin = f16(blocks[:, :2]), f16(blocks[:, 2:4])
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
        # gguf: (d * sc) * q - dmin * m; the offset is kept negated (x + -y == x - y).
        scale = (d * sc.astype(np.float32)).reshape(n, -1)
        offset = -(dmin * mn.astype(np.float32)).reshape(n, -1)
        q = nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(n, k)  # per 32 bytes: 32 low halves, 32 high
        return _quantized(0, q, scale, offset)
    raise ValueError(f"cpu_quant: GGUF type {type_name} is not kept quantized")


def _quantized(kind: int, q: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> Quantized:
    return Quantized(kind, torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)),
                     torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32)),
                     None if m is None else torch.from_numpy(np.ascontiguousarray(m, dtype=np.float32)))


@dataclass(slots=True)
class QPanels:
    """A quantized weight [n, k] in the kernel's panels (cpu_quant.c): codes [panels, ...]
    and scales [panels, k / 32, 2, NR], float16 or float32 (gate/up: their panels in turn).
    `dot`: x rounded to 8 bits for integer products (quantization q8), else exact fp32
    products."""
    bits: int
    codes: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int
    dot: bool = False

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    @property
    def half(self) -> bool:
        return self.scales.dtype == torch.float16

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self, bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_mul(x, self)


_fns: dict[str, object] = {}


def load() -> bool:
    """Whether the kernel is here (built, or built now); False where it cannot be built."""
    return cpu_build.functions("cpu_quant", _fns, {
        "nr": ("fanout_quant_nr", [], I64),
        "linear": ("fanout_quant_linear", [I64, I64, P, I64, I64, I64, P, P, I64, I64, P, P, I64]),
        "silu_mul": ("fanout_quant_silu_mul", [I64, I64, P, I64, I64, I64, P, P, I64, I64, P, I64]),
        "rows": ("fanout_quant_rows", [I64, P, P, I64, I64, I64, P, I64, P], I64)})


def _panels(w: Quantized, half: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [panels, ...], scales [panels, k / 32, 2, NR]: d, o, float16 where half); the
    last panel's missing columns zero."""
    nr = _fns["nr"]()
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"cpu_quant: {k} input columns, not a whole number of {GROUP}-weight groups")
    rows = -(-n // nr) * nr

    def pad(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(rows, *t.shape[1:], dtype=t.dtype)
        out[:n] = t
        return out

    q = pad(w.q).view(-1, nr, k // GROUP, GROUP)  # [panels, NR, groups, 32]
    if w.kind == 2:  # [panels, groups, 8, NR, 4]: k = 32 G + 4 t + b, signed bytes
        codes = q.view(-1, nr, k // GROUP, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    else:  # [panels, groups, 4, NR, 4]: k = 32 G + 8 t + b in the low half, + 4 in the high
        eights = q.view(-1, nr, k // GROUP, 4, 2, 4)
        codes = (eights[..., 0, :] | (eights[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).contiguous()
    scales = torch.stack([pad(s).view(-1, nr, k // GROUP) for s in (w.d, w.offset())], dim=2)  # [panels, NR, 2, G]
    scales = scales.permute(0, 3, 2, 1).contiguous()
    return codes, scales.half() if half else scales


def pack(w: Quantized, dot: bool = False) -> QPanels:
    """A quantized weight [n, k] (call load() first)."""
    return QPanels(w.bits, *_panels(w, w.half), *w.shape, dot)


def pack_gate_up(gate: Quantized, up: Quantized, dot: bool = False) -> QPanels:
    """The MLP's gate and up, their panels interleaved for `silu_mul`."""
    if gate.bits != up.bits:
        raise ValueError("cpu_quant: gate and up of different widths")
    half = gate.half and up.half
    (gc, gs), (uc, us) = _panels(gate, half), _panels(up, half)
    codes = torch.stack([gc, uc], dim=1).flatten(0, 1).contiguous()
    scales = torch.stack([gs, us], dim=1).flatten(0, 1).contiguous()
    return QPanels(gate.bits, codes, scales, *gate.shape, dot)


def linear(x: torch.Tensor, w: QPanels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] float32 -> x W^T (+ bias) [m, n]."""
    x = matmul_input(x, w.k, "cpu_quant")
    y = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    _fns["linear"](w.bits, w.dot, x.data_ptr(), x.shape[0], w.k, x.stride(0), w.codes.data_ptr(),
                   w.scales.data_ptr(), w.half, w.n, None if bias is None else bias.data_ptr(), y.data_ptr(), w.n)
    return y


def silu_mul(x: torch.Tensor, w: QPanels) -> torch.Tensor:
    """x [m, k] float32 -> silu(x Wg^T) * (x Wu^T) [m, n], w from pack_gate_up."""
    x = matmul_input(x, w.k, "cpu_quant")
    y = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    _fns["silu_mul"](w.bits, w.dot, x.data_ptr(), x.shape[0], w.k, x.stride(0), w.codes.data_ptr(),
                     w.scales.data_ptr(), w.half, w.n, y.data_ptr(), w.n)
    return y


def rows(ids: torch.Tensor, w: QPanels) -> torch.Tensor:
    """Rows `ids` of W, float32 [len(ids), k]: an embedding lookup from the panels."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), w.k, dtype=torch.float32)
    bad = _fns["rows"](w.bits, w.codes.data_ptr(), w.scales.data_ptr(), w.half, w.k, w.n, ids.data_ptr(),
                       ids.numel(), out.data_ptr())
    if bad:  # (checked in C: two torch reductions here took longer than the lookup)
        raise IndexError(f"cpu_quant: row ids must lie in [0, {w.n}), got {int(ids.flatten()[bad - 1])}")
    return out.view(*ids.shape, w.k)
