"""The interface the model code calls for attention over the paged KV cache."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from ..batch import ForwardBatch


class AttentionMetadata:
    """What a backend derives from a batch once per forward pass, shared by all layers. It
    travels on the batch (`ForwardBatch.attn_meta`), never on the backend, so a CUDA graph's
    static batch keeps its own."""


class AttentionBackend(ABC):
    """Stores the new tokens' K/V in their slots and attends over each request's cached KV.

    `prepare` runs once per eager forward pass; `forward` runs per layer: `store`, then
    `attend` (a caller that writes the K/V itself, as the CPU's fused RoPE does, calls `attend`
    alone), each layer within its sliding window, if it has one. Shapes: q [T, Hq, D]; k, v
    [T, Hkv, D]; returns [T, Hq, D] in q's dtype. A backend whose decode `forward` is
    capturable (fixed-size device tensors, no host reads) sets `supports_cuda_graph` and gives
    the two graph hooks: `prepare_capture` (metadata of a static batch, made once before its
    capture) and `prepare_replay` (refresh it from the static buffers before each replay).
    """

    supports_cuda_graph: ClassVar[bool] = False
    # Whether forward attends to fb.shared groups; the batch builds them only then.
    uses_shared_prefixes: bool = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 windows: tuple[int, ...] = (), softcap: float = 0.0):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5
        # Each layer's sliding window (ModelConfig.windows): a query at position i sees keys
        # i - window + 1 .. i; 0 (or no entry): all of 0 .. i. Keys before the window stay in
        # the pool (the KV and radix cache keep whole sequences: nothing is freed early).
        self.windows = tuple(windows)
        # > 0: every score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2).
        self.softcap = float(softcap or 0.0)

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    @abstractmethod
    def prepare(self, fb: ForwardBatch) -> AttentionMetadata:
        """Per-batch metadata for an eager forward."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                fb: ForwardBatch) -> torch.Tensor:
        """One layer's attention, with fb.attn_meta from prepare (or prepare_capture)."""
        self.store(k, v, layer, fb)
        return self.attend(q, layer, fb)

    @abstractmethod
    def store(self, k: torch.Tensor, v: torch.Tensor, layer: int, fb: ForwardBatch) -> None:
        """The new tokens' K/V into their slots (fb.out_cache_loc) of the layer's pools."""

    @abstractmethod
    def attend(self, q: torch.Tensor, layer: int, fb: ForwardBatch) -> torch.Tensor:
        """Attention of q over each request's KV, the new tokens' included (stored)."""

    def prepare_capture(self, fb: ForwardBatch) -> AttentionMetadata:
        """Metadata of a CUDA graph's static decode batch; must stay valid across replays."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    def prepare_replay(self, fb: ForwardBatch, meta: AttentionMetadata) -> None:
        """Update meta in place for the inputs just copied into fb's static buffers."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")


def make_backend(name: str, device: torch.device, dtype: torch.dtype, **kw) -> AttentionBackend:
    """`auto` picks Triton on CUDA and torch elsewhere. dtype: the model's and the KV pool's."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from .torch_backend import TorchBackend
        return TorchBackend(device=device, dtype=dtype, **kw)
    if name == "triton":
        from .triton_backend import TritonBackend
        return TritonBackend(**kw)
    raise ValueError(f"attention_backend: unknown backend {name!r} (use 'auto', 'torch' or 'triton')")
