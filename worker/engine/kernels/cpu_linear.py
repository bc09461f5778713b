"""The CPU matmul kernel (cpu_linear.c), built and loaded by cpu_build.py: every projection of a
model's forward in fp32 on a CPU, from weights packed once into its panels.

Why C: a decode step multiplies a few rows by every weight of the model, so it is bound by
reading the weights. oneDNN's prepacked fp32 matmul read them at about 21 GB/s on a 2-core
x86 that streams 51 GB/s, and MKL's dense one repacks the weight on every call. The kernel
reads each weight once per call, a few KB ahead of its FMAs. SmolLM2-135M's projections and
lm_head, 30 layers' worth of distinct weights (so from memory, as in a step): 8 rows 21.0 ms
against oneDNN's 30.3, 16 rows 27.8 against 37.6, 64 rows 94.8 against 127.9; at prefill sizes
(300-2,048 rows) the two are level (~190 GFLOP/s on 2 cores; that was a 2-core AMD EPYC). On a
2-core Intel Xeon with AVX-512, a weight of 3,072 x 576: 16 rows 222 GFLOP/s against F.linear's
137, 64 rows 296 against 226, 2,048 rows ~307 against MKL's ~330. The MLP's gate and up run as
one call that writes silu(gate) * up (`pack_gate_up`, `silu_mul`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_build
from .cpu_build import I64, P


@dataclass(slots=True)
class Panels:
    """A weight [n, k] packed for the kernel: [panels, k, NR] (gate/up: their panels in turn)."""
    data: torch.Tensor
    n: int  # output columns
    k: int  # input columns

    @property
    def nbytes(self) -> int:
        return self.data.numel() * 4

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self, bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_mul(x, self)


_fns: dict[str, object] = {}


def load() -> bool:
    """Whether the kernel is here (built, or built now); False where it cannot be built."""
    return cpu_build.functions("cpu_linear", _fns, {
        "nr": ("fanout_linear_nr", [], I64),
        "linear": ("fanout_linear", [P, I64, I64, I64, P, I64, P, P, I64]),
        "silu_mul": ("fanout_linear_silu_mul", [P, I64, I64, I64, P, I64, P, I64])})


def _panels(weight: torch.Tensor) -> torch.Tensor:
    """[n, k] -> [ceil(n / NR), k, NR], the last panel's missing columns zero."""
    nr = _fns["nr"]()
    n, k = weight.shape
    padded = torch.zeros(-(-n // nr) * nr, k, dtype=torch.float32)
    padded[:n] = weight
    return padded.view(-1, nr, k).transpose(1, 2).contiguous()


def pack(weight: torch.Tensor) -> Panels:
    """A float32 weight [n, k] (call load() first)."""
    return Panels(_panels(weight.detach()), *weight.shape)


def pack_gate_up(gate: torch.Tensor, up: torch.Tensor) -> Panels:
    """The MLP's gate and up [n, k] each, their panels interleaved for `silu_mul`."""
    both = torch.stack([_panels(gate.detach()), _panels(up.detach())], dim=1)
    return Panels(both.flatten(0, 1).contiguous(), *gate.shape)


def matmul_input(x: torch.Tensor, k: int, kernel: str = "cpu_linear") -> torch.Tensor:
    """x as the CPU matmul kernels take it (this one's and cpu_quant's): float32 [m, k], each
    row contiguous; a ValueError naming the kernel otherwise."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{kernel}: x {tuple(x.shape)} {x.dtype}, weight takes {k} float32 columns")
    return x if x.stride(1) == 1 else x.contiguous()


def linear(x: torch.Tensor, w: Panels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] float32 -> x W^T (+ bias) [m, n]."""
    x = matmul_input(x, w.k)
    y = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    _fns["linear"](x.data_ptr(), x.shape[0], w.k, x.stride(0), w.data.data_ptr(), w.n,
                   None if bias is None else bias.data_ptr(), y.data_ptr(), w.n)
    return y


def silu_mul(x: torch.Tensor, w: Panels) -> torch.Tensor:
    """x [m, k] float32 -> silu(x Wg^T) * (x Wu^T) [m, n], w from pack_gate_up."""
    x = matmul_input(x, w.k)
    y = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    _fns["silu_mul"](x.data_ptr(), x.shape[0], w.k, x.stride(0), w.data.data_ptr(), w.n,
                     y.data_ptr(), w.n)
    return y
