"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top_k experts,
and each expert, a gated MLP of its own, runs once over all the tokens routed to it.

The tokens' (token, expert) pairs are sorted by expert, so each expert's rows are one
contiguous slice: one matmul pair per expert that has tokens, however many tokens the batch
holds (a grouped matmul as a loop over the experts), not one per token. The outputs, weighed
by the routing probabilities, are added back to their tokens in expert order, as
transformers adds them. On a GPU the same runs as two Triton grouped matmuls over the pairs
sorted on the device (kernels/fused_moe.py), each block of rows one expert's; the CPU's loop
reads the counts per expert on the host. A MoE model runs without CUDA graphs for now
(model_runner.py): the fused path has not been captured on a device yet.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import TP

if TYPE_CHECKING:
    from .config import MoEConfig


class MoE(nn.Module):
    """Parameters: `router` ([experts, hidden]), `experts_gate_up` ([experts, 2 x
    intermediate, hidden]: each expert's gate then up rows) and `experts_down` ([experts,
    hidden, intermediate]); the loader stacks them from the checkpoint's per-expert weights
    (registry.py)."""

    def __init__(self, moe: MoEConfig, hidden_size: int, tp: TP = TP()):
        """`moe`: this rank's (its share of every expert's intermediate rows, parallel.py)."""
        super().__init__()
        self.tp = tp
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.renormalize, self.weights_in_model_dtype = moe.renormalize, moe.weights_in_model_dtype
        self.router = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(moe.num_experts, hidden_size, moe.intermediate_size))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, top_k] fp32, experts [T, top_k])."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        return self.tp.all_reduce((self.fused if x.is_cuda else self.loop)(x, weights, experts))

    def loop(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The experts in turn, each over its tokens (the module doc)."""
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, expert) pairs grouped by expert
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x[tokens]
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                gate, up = F.linear(xs[start:start + n], self.experts_gate_up[e]).chunk(2, dim=-1)
                out[start:start + n] = F.linear(F.silu(gate) * up, self.experts_down[e])
                start += n
        w = weights.flatten()[order, None]
        out = out * w.to(out.dtype) if self.weights_in_model_dtype else (out * w).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def fused(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """forward's sum through the Triton kernels (kernels/fused_moe.py; on a CPU, under the
        Triton interpreter: the tests'). The routing weights are applied in fp32 (Mixtral's
        way; Qwen3-MoE's product in the model's dtype differs by its rounding only)."""
        from ..kernels import fused_moe
        T, k = experts.shape
        ids, blocks = fused_moe.align(experts, self.num_experts)
        h = fused_moe.expert_matmul(x, self.experts_gate_up, ids, blocks, T * k, row_div=k)
        gate, up = h.chunk(2, dim=-1)
        y = fused_moe.expert_matmul((F.silu(gate) * up).contiguous(), self.experts_down, ids, blocks,
                                    T * k, row_div=1, weights=weights.flatten().float())
        return y.view(T, k, -1).sum(dim=1)
