"""Tensor parallel: how one model is split over the ranks of a worker, and the collectives
that join the parts (Megatron's layout, as SGLang and vLLM run it).

- q/k/v and gate/up are column-parallel: each rank holds its heads' rows (its share of the
  intermediate rows) and computes them alone;
- o_proj and down_proj are row-parallel: each rank holds the matching input columns, and
  its partial sums are added over the ranks (all-reduce) before the bias and the residual;
- KV heads are split like the query heads, or replicated where the model has fewer than
  the ranks (ranks r*kv/N.. share one head; its query heads stay with it);
- a mixture of experts splits every expert's intermediate rows the same way, the router
  replicated;
- the token embeddings and the lm_head are vocab-parallel: each rank holds ceil(V/N) rows
  (the last padded); a lookup is its rank's rows or zeros, all-reduced; logits are
  all-gathered and cut to V.

Everything else (norms, RoPE, the attention itself over the rank's heads) runs on every
rank alike. `Split` says which rows or columns of a checkpoint tensor a rank keeps; the
loader applies it (loader.py). The ranks' processes and the steps they are sent: ranks.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # the models import this module
    from .models.config import ModelConfig


def even(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"tensor_parallel_size: {parts} does not divide the model's {n} {what}")
    return n // parts


@dataclass(frozen=True, slots=True)
class Split:
    """A rank's share of a parameter: the checkpoint tensor (its parts concatenated, as the
    loader makes it) narrowed to each range along dim, the pieces concatenated; `rows` pads
    dim 0 with zeros to that many (the vocab's last rank)."""
    dim: int
    ranges: tuple[tuple[int, int], ...]
    rows: int | None = None

    def take(self, w: torch.Tensor) -> torch.Tensor:
        out = torch.cat([w.narrow(self.dim, a, b - a) for a, b in self.ranges], dim=self.dim)
        if self.rows is not None and out.shape[0] < self.rows:
            out = torch.cat([out, out.new_zeros(self.rows - out.shape[0], *out.shape[1:])])
        return out


@dataclass(frozen=True, slots=True)
class TP:
    """This process's place among a worker's ranks. `group` carries the tensors (NCCL on
    GPUs, gloo on CPUs); size 1 is a worker alone, whose collectives are no-ops."""
    rank: int = 0
    size: int = 1
    group: object = None

    def reducer(self) -> TP | None:
        """What a row-parallel layer sums over: these ranks, or None alone."""
        return self if self.size > 1 else None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x, concatenated along the last dim in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def share(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of n split evenly."""
        k = n // self.size
        return self.rank * k, (self.rank + 1) * k

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(start, stop, rows): this rank's vocab rows, and the rows every rank holds."""
        rows = -(-vocab_size // self.size)
        start = min(self.rank * rows, vocab_size)
        return start, min(start + rows, vocab_size), rows

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """This rank's KV heads [start, stop): its share, or the one head its query heads use."""
        if num_kv_heads >= self.size:
            return self.share(num_kv_heads)
        h = self.rank * num_kv_heads // self.size
        return h, h + 1

    def local(self, cfg: ModelConfig) -> ModelConfig:
        """The model as one rank holds it: its heads and intermediate rows (the vocab stays
        whole in the config; the embeddings split it themselves)."""
        if self.size == 1:
            return cfg
        even(cfg.num_heads, self.size, "attention heads")
        if cfg.num_kv_heads >= self.size:
            even(cfg.num_kv_heads, self.size, "KV heads")
        elif self.size % cfg.num_kv_heads:
            raise ValueError(f"tensor_parallel_size: {self.size} is not a multiple of the model's "
                             f"{cfg.num_kv_heads} KV heads (fewer than the ranks, they are replicated)")
        moe = cfg.moe and dataclasses.replace(
            cfg.moe, intermediate_size=even(cfg.moe.intermediate_size, self.size, "expert intermediate rows"))
        start, stop = self.kv_heads(cfg.num_kv_heads)
        return dataclasses.replace(cfg, num_heads=cfg.num_heads // self.size, num_kv_heads=stop - start,
                                   intermediate_size=even(cfg.intermediate_size, self.size, "intermediate rows"),
                                   moe=moe)

    def splits(self, cfg: ModelConfig, names) -> dict[str, Split]:
        """This rank's Split of each parameter named (ours, loader.py) that is split; the
        others are replicated. `cfg` is the whole model's."""
        if self.size == 1:
            return {}
        d = cfg.head_dim
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        qa, qb = (x * d for x in self.share(cfg.num_heads))
        ka, kb = (x * d for x in self.kv_heads(cfg.num_kv_heads))
        ia, ib = self.share(cfg.intermediate_size)
        va, vb, rows = self.vocab(cfg.vocab_size)
        qkv = Split(0, ((qa, qb), (q + ka, q + kb), (q + kv + ka, q + kv + kb)))
        by_leaf = {
            "qkv_proj.weight": qkv, "qkv_proj.bias": qkv,
            "o_proj.weight": Split(1, ((qa, qb),)),
            "gate_up_proj.weight": Split(0, ((ia, ib), (cfg.intermediate_size + ia, cfg.intermediate_size + ib))),
            "gate_up_proj.bias": Split(0, ((ia, ib), (cfg.intermediate_size + ia, cfg.intermediate_size + ib))),
            "down_proj.weight": Split(1, ((ia, ib),)),
            "embed_tokens.weight": Split(0, ((va, vb),), rows),
            "lm_head.weight": Split(0, ((va, vb),), rows),
        }
        if cfg.moe is not None:
            n, e = cfg.moe.intermediate_size, cfg.moe.num_experts
            ea, eb = self.share(n)
            # Stacked expert by expert (gate, up; down), concatenated along dim 0 by the loader.
            by_leaf["experts_gate_up"] = Split(0, tuple((j * n + ea, j * n + eb) for j in range(2 * e)))
            by_leaf["experts_down"] = Split(1, ((ea, eb),))
        out = {}
        for name in names:
            leaf = ".".join(name.split(".")[-2:])
            split = by_leaf.get(leaf) or by_leaf.get(name.rpartition(".")[2])
            if split is not None:
                out[name] = split
        return out
