"""Weight-only 8-bit matmuls on the GPU, in Triton: y = x (W * scale)^T + bias with W int8 (or
float8 e4m3 where the GPU has it) and one scale per output row, x in the model's dtype.

Why: a decode step at a small batch reads every weight, so its time is the weights' bytes
over the memory's bandwidth; 8-bit weights halve a bf16 model's bytes. A program takes a
BLOCK_M x BLOCK_N tile of y: it loads the 8-bit tile of W, widens it to x's dtype in
registers, accumulates x W^T in fp32 over K with tl.dot, and applies the scale once at the
end (it factors out of the sum over K). `quantize` makes W and its scales from a dense
weight (symmetric, per output row: absmax / 127, or / 448 for e4m3).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


@dataclass(slots=True)
class W8:
    """An 8-bit weight [n, k] and its scales [n] (float32)."""
    q: torch.Tensor
    scale: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self, bias)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scale[:, None]).to(dtype)


def quantize(w: torch.Tensor, fmt: str = "int8") -> W8:
    """A dense weight [n, k] -> its 8-bit form, per output row."""
    if fmt not in FORMATS:
        raise ValueError(f"weight format {fmt!r}: use one of {', '.join(FORMATS)}")
    dtype, top = FORMATS[fmt]
    w = w.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / top).clamp(min=1e-12)
    scaled = w / scale[:, None]
    q = scaled.round().clamp(-top, top).to(dtype) if fmt == "int8" else scaled.to(dtype)
    return W8(q.contiguous(), scale.contiguous())


@triton.jit
def _w8_linear(X, W, Scale, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(W + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0)
        acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
    acc = acc * tl.load(Scale + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def linear(x: torch.Tensor, w: W8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] (last dim contiguous) -> x (W * scale)^T (+ bias) [m, n], in x's dtype."""
    n, k = w.q.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"w8_linear: x {tuple(x.shape)}, weight takes {k} columns")
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    # Decode's few rows: 16-row tiles (tl.dot's least); prefill's: 64.
    block_m = 16 if x.shape[0] <= 16 else 64
    block_n, block_k = 64, 64
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(n, block_n))
    _w8_linear[grid](x, w.q, w.scale, bias if bias is not None else y, y, x.shape[0], n, k,
                     x.stride(0), w.q.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                     BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
