"""Loads the model, sizes the KV pool, captures the decode CUDA graphs, and runs one forward
pass per ForwardBatch.

Sizing on a GPU: after the weights are loaded, a warm-up forward of `max_prefill_tokens`
tokens (logits for every one of them: the largest step the scheduler can run) measures peak
activation memory, and an eager run of the largest padded decode batch estimates what the
CUDA graphs will hold. The KV pool gets `kv_memory_fraction` of the memory still free once
those two are set aside.
"""
from __future__ import annotations

import logging
import math
import time

import torch

from .attention.base import make_backend
from .batch import ForwardBatch, ForwardMode
from .cuda_graph import CudaGraphRunner, batch_sizes
from .kv_pool import KVPool, ReqToTokenPool
from .models.loader import load_model

log = logging.getLogger("fanout.engine")
MiB = 2**20


class ModelRunner:
    def __init__(self, model_path: str, device: torch.device, dtype: torch.dtype, page_size: int,
                 kv_tokens: int | None, kv_memory_fraction: float, max_running: int,
                 attention_backend: str = "auto", max_prefill_tokens: int = 2048,
                 cuda_graph: bool = True, cuda_graph_max_bs: int | None = None,
                 cuda_graph_batch_sizes: list[int] | None = None):
        if not 0 < kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction: must be in (0, 1], got {kv_memory_fraction}")
        if max_running < 1:
            raise ValueError(f"max_running: must be >= 1, got {max_running}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens: must be >= 1, got {max_prefill_tokens}")
        if kv_tokens is not None and kv_tokens < 1:
            raise ValueError(f"kv_tokens: must be >= 1, got {kv_tokens}")
        sizes = batch_sizes(cuda_graph_max_bs, cuda_graph_batch_sizes, max_running)
        self.device = device
        self.dtype = dtype
        self.model, self.config = load_model(model_path, dtype, device)
        c = self.config
        self.max_context = c.max_context
        self.page_size = page_size
        # One row more than requests can hold: the scratch row of padded graph rows. Taken
        # here and never freed, so the allocator never hands it out; its slots stay 0.
        self.req_to_token = ReqToTokenPool(max_running + 1, c.max_context, device)
        self.scratch_row = self.req_to_token.alloc()
        self.attn = make_backend(attention_backend, device, num_heads=c.num_heads,
                                 num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
        if not cuda_graph or device.type != "cuda":
            sizes = []
        elif attention_backend == "torch":  # host-side metadata per batch: not capturable
            log.warning("CUDA graphs off: the torch attention backend cannot be captured")
            sizes = []
        self.mem = {"weights": sum(p.numel() * p.element_size() for p in self.model.parameters())}
        if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
            self.model.pack_weights()  # measured in fp32 only (oneDNN fp16 needs AVX512-FP16)
        per_token = KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, dtype)
        if kv_tokens is None:
            kv_tokens = self._default_kv_tokens(per_token, kv_memory_fraction, max_prefill_tokens,
                                                max(sizes, default=0))
        num_pages = max(2, kv_tokens // page_size + 1)  # +1: the scratch page
        self.kv = KVPool(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, dtype, device)
        self.kv_tokens = (num_pages - 1) * page_size
        self.mem["kv"] = num_pages * page_size * per_token
        log.info("KV pool: %d tokens (%d pages of %d), %.1f MiB", self.kv_tokens, num_pages - 1,
                 page_size, self.mem["kv"] / MiB)
        self.graphs: CudaGraphRunner | None = None
        if sizes:
            torch.cuda.empty_cache()  # capture empties the cache too: do it before measuring
            free = torch.cuda.mem_get_info(device)[0]
            t = time.perf_counter()
            self.graphs = CudaGraphRunner(self, sizes)
            self.mem["graphs"] = free - torch.cuda.mem_get_info(device)[0]
            log.info("CUDA graphs: %d batch sizes up to %d captured in %.1f s, %.1f MiB",
                     len(sizes), sizes[-1], time.perf_counter() - t, self.mem["graphs"] / MiB)

    def _default_kv_tokens(self, per_token: int, fraction: float, max_prefill_tokens: int,
                           graph_bs: int) -> int:
        if self.device.type != "cuda":
            # CPU: enough for many full-context requests, at most 2 GiB.
            return min(2 * 2**30 // per_token, 64 * self.max_context)
        dev = self.device
        ps = self.page_size
        torch.cuda.synchronize(dev)
        # A temporary pool just big enough for the warm-up batch.
        kv = KVPool(self.config.num_layers, math.ceil(max_prefill_tokens / ps) + 1, ps,
                    self.config.num_kv_heads, self.config.head_dim, self.dtype, dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        self._warmup(kv, max_prefill_tokens)
        self.mem["activations"] = torch.cuda.max_memory_allocated(dev) - base
        self.mem["graphs_estimate"] = 0
        if graph_bs:
            torch.cuda.reset_peak_memory_stats(dev)
            probe = CudaGraphRunner(self, [graph_bs], capture=False, kv=kv)
            probe.forward(graph_bs)  # every row padding, as at capture
            torch.cuda.synchronize(dev)
            self.mem["graphs_estimate"] = torch.cuda.max_memory_allocated(dev) - base
            del probe
        del kv
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(dev)[0]
        spare = free - self.mem["activations"] - self.mem["graphs_estimate"]
        log.info("GPU memory: %.0f MiB free after weights (%.0f MiB); warm-up activations "
                 "%.0f MiB, CUDA graphs about %.0f MiB; KV gets %.0f%% of the rest",
                 free / MiB, self.mem["weights"] / MiB, self.mem["activations"] / MiB,
                 self.mem["graphs_estimate"] / MiB, fraction * 100)
        if spare <= 0:
            raise RuntimeError(f"no GPU memory left for the KV cache ({free / MiB:.0f} MiB free, "
                               f"activations and graphs need more); lower max_prefill_tokens "
                               f"or cuda_graph_max_bs")
        return int(spare * fraction) // per_token

    @torch.inference_mode()
    def _warmup(self, kv: KVPool, num_tokens: int) -> None:
        """One EXTEND forward of num_tokens new tokens (prompts of up to max_context tokens,
        in rows taken from req_to_token and given back), with logits for every token."""
        ps, table = self.page_size, self.req_to_token.table
        # No step holds more than max_running prompts of at most max_context tokens.
        num_tokens = min(num_tokens, self.req_to_token.num_free * self.max_context)
        lens = [min(self.max_context, num_tokens - i)
                for i in range(0, num_tokens, self.max_context)]
        rows = [self.req_to_token.alloc() for _ in lens]
        slots, t = [], ps  # page 1 on: page 0 is scratch
        for row, n in zip(rows, lens):
            table[row, :n] = torch.arange(t, t + n, device=self.device)
            slots.append(table[row, :n])
            t += n
        dev = self.device
        starts = [sum(lens[:i]) for i in range(len(lens))]

        def tensor(x):
            return torch.tensor(x, dtype=torch.int64, device=dev)

        fb = ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=dev),
            positions=torch.cat([torch.arange(n, device=dev) for n in lens]),
            out_cache_loc=torch.cat(slots), req_pool_indices=tensor(rows), seq_lens=tensor(lens),
            prefix_lens=tensor([0] * len(lens)), extend_lens=tensor(lens),
            extend_start_loc=tensor(starts), seq_lens_cpu=lens, prefix_lens_cpu=[0] * len(lens),
            extend_lens_cpu=lens, req_to_token=table, kv=kv,
            logits_idx=torch.arange(num_tokens, device=dev))
        self.forward_eager(fb)
        for row in rows:
            table[row].zero_()
            self.req_to_token.free(row)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [len(fb.logits_idx), vocab] in float32: from a CUDA graph for a decode
        batch that fits one (a view valid until the next forward), else eagerly."""
        if self.graphs is not None and self.graphs.can_run(fb):
            return self.graphs.run(fb)
        return self.forward_eager(fb)

    @torch.inference_mode()
    def forward_eager(self, fb: ForwardBatch) -> torch.Tensor:
        fb.attn = self.attn
        self.attn.prepare(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        return self.model.logits(hidden[fb.logits_idx])
