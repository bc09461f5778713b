"""The interface the model code calls for attention over the paged KV cache."""
from __future__ import annotations

import torch


class AttentionBackend:
    """Stores the new tokens' K/V in their slots and attends over each request's cached KV.

    `prepare` runs once per forward pass (metadata shared by all layers); `forward` runs
    per layer. Shapes: q [T, Hq, D]; k, v [T, Hkv, D]; returns [T, Hq, D] in q's dtype.
    """

    # Whether forward attends to fb.shared groups; the scheduler builds them only then.
    uses_shared_prefixes = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5

    def prepare(self, fb) -> None:
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, fb) -> torch.Tensor:
        raise NotImplementedError


def make_backend(name: str, device: torch.device, **kw) -> AttentionBackend:
    """`auto` picks Triton on CUDA and torch elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from .torch_backend import TorchBackend
        return TorchBackend(device=device, **kw)
    if name == "triton":
        from .triton_backend import TritonBackend
        return TritonBackend(**kw)
    raise ValueError(f"attention_backend: unknown backend {name!r} (use 'auto', 'torch' or 'triton')")
