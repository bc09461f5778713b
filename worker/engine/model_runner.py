"""Loads the model, sizes the KV pool (KVManager allocates it), captures the decode CUDA
graphs, and runs one forward pass per ForwardBatch.

Sizing on a GPU: after the weights are loaded, a warm-up forward of `max_prefill_tokens`
tokens (logits for every one of them: the largest step the scheduler can run) measures peak
activation memory, and an eager run of the largest padded decode batch estimates what the
CUDA graphs will hold. The KV pool gets `kv_memory_fraction` of the memory still free once
those two are set aside (the LoRA adapter slots, lora.py, are allocated before: gone too).

Sizing on a CPU: room for every running request at a typical length (`max_running` x
CPU_TOKENS_PER_REQUEST tokens, and at least one full context), at most a quarter of the
memory available at start. The pool's memory is taken only as its pages are first used
(kv_pool.py): a worker holds what its requests and its prefix cache have used, up to that.
"""
from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from .attention.base import make_backend
from .batch import ForwardBatch, ForwardMode
from .config import EngineConfig
from .cuda_graph import CudaGraphRunner, batch_sizes, cpu_batch_sizes
from .host_memory import available_memory, keep_freed_blocks
from .kernels import cpu_graph, cpu_linear, cpu_quant
from .kv_pool import KVPool, ReqToTokenPool
from .lora import Loras, parse_specs
from .models.loader import load_model, resolve_dtype
from .models.llama import quantize_linears
from .parallel import TP
from .ranks import Ranks, cpu_threads, rank_device

log = logging.getLogger("fanout.engine")
MiB = 2**20
GiB = 2**30
CPU_TOKENS_PER_REQUEST = 1024  # a running request's share of a default CPU pool (prompt and output)


def resolve_device(name: str) -> torch.device:
    """A torch device; "auto" is cuda when there is one, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def use_threads(threads: int | None) -> None:
    """torch's CPU threads for this process (EngineConfig.threads; None: torch's default,
    every core it may use)."""
    if threads is not None:
        torch.set_num_threads(threads)


def cpu_kv_tokens(per_token: int, max_running: int, max_context: int,
                  available: int | None) -> tuple[int, str]:
    """The module doc's CPU rule (2 GiB at most where the free memory is unknown): the
    pool's tokens, and why."""
    share = min(max_context, CPU_TOKENS_PER_REQUEST)
    want = max(max_context, max_running * share)
    cap = (available // 4 if available is not None else 2 * GiB) // per_token
    if want <= max(cap, max_context):
        return want, f"{max_running} running requests x {share} tokens"
    bound = "2 GiB (the free memory is unknown)" if available is None else \
        f"a quarter of the {available / GiB:.1f} GiB available"
    if cap < max_context:
        return max_context, f"one full context, more than {bound}"
    return cap, bound


def codes_unkept(cfg: EngineConfig, device: torch.device, dtype: torch.dtype, tp: TP) -> str | None:
    """Why a GGUF's quantized matrices cannot stay as codes here (the CPU kernels multiply by
    them in fp32; adapters add to the dense products; codes are not split over ranks), or
    None where they can."""
    if device.type != "cpu" or dtype != torch.float32:
        return f"the codes' products run on a CPU in float32, this is {device.type} in " \
               f"{str(dtype).removeprefix('torch.')} (on a GPU: int8 or fp8)"
    if cfg.lora_slots or tp.size > 1:
        return "the codes' products run on one rank, without LoRA adapters"
    if not (cpu_linear.load() and cpu_quant.load()):
        return "the CPU kernels could not be built (no C compiler)"
    return None


def check_eight_bit(fmt: str, device: torch.device) -> None:
    """int8 / fp8 weights are the GPU's (Triton kernels); fp8 needs e4m3 (compute capability 8.9+)."""
    if device.type != "cuda":
        raise ValueError(f"quantization {fmt}: 8-bit weights run on a GPU; on a CPU, a GGUF file's "
                         "Q8_0 and Q4 matrices stay quantized (quantization auto, or q8 for "
                         "integer products)")
    if fmt == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"quantization fp8: this GPU (compute capability "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}) has no "
                         "float8 e4m3; use int8")


def weight_bytes(model: torch.nn.Module) -> int:
    """The model's weights in memory: its parameters, or the codes the loader kept for them."""
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    kept = [getattr(m, "quant", None) or getattr(m, "packed", None) for m in model.modules()]
    return dense + sum(k.nbytes for k in kept if k is not None)


class ModelRunner:
    """Owns the model and the attention backend; uses (never allocates from) the KV pools
    that `attach_kv` hands it."""

    def __init__(self, model_path: str, cfg: EngineConfig, tp: TP | None = None):
        """`tp`: a follower's rank (ranks.py). None: rank 0, which starts the followers when
        cfg.tensor_parallel_size asks for them, and sends them every forward."""
        size = cfg.tensor_parallel_size
        use_threads(cfg.threads or (cpu_threads(size) if size > 1 else None))
        device = resolve_device(cfg.device)
        self.ranks: Ranks | None = None
        if tp is None and size > 1:
            self.ranks = Ranks(model_path, cfg, device)
            tp = self.ranks.tp
        self.tp = tp or TP()
        self.device = rank_device(device, self.tp.rank)
        try:
            self._load(model_path, cfg)
        except BaseException as e:
            raise self.abort(e)

    def _load(self, model_path: str, cfg: EngineConfig) -> None:
        # fp32 on a CPU (fast matmuls, exact tests), bf16 on a GPU, unless asked.
        self.dtype = resolve_dtype(cfg.dtype or ("bfloat16" if self.device.type == "cuda" else "float32"))
        self.cfg = cfg
        eight_bit = cfg.quantization in ("int8", "fp8")
        if eight_bit:
            check_eight_bit(cfg.quantization, self.device)
        # A GGUF's quantized matrices stay as codes where the CPU kernels can multiply by them;
        # q8 (their integer products) is refused where they cannot.
        keep = cfg.quantization in ("auto", "q8")
        unkept = codes_unkept(cfg, self.device, self.dtype, self.tp) if keep else None
        if cfg.quantization == "q8" and unkept:
            raise ValueError(f"quantization q8: {unkept}")
        codes = keep and unkept is None
        self.model, self.config = load_model(model_path, self.dtype, self.device, quantized=codes, tp=self.tp)
        if eight_bit:
            n = quantize_linears(self.model, cfg.quantization)
            log.info("weights: %d linear layers in %s, a scale per output row", n, cfg.quantization)
        c = self.config
        self.max_context = c.max_context
        self.attn = make_backend(cfg.attention_backend, self.device, self.dtype, num_heads=c.num_heads,
                                 num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, windows=c.windows,
                                 scale=c.attention_scale(), softcap=c.attention_softcap())
        self.graph_sizes: list[int] = []
        if cfg.cuda_graph and self.device.type == "cuda":
            if c.moe is not None:
                log.warning("CUDA graphs off: the mixture-of-experts layers read their routing on the host")
            elif self.attn.supports_cuda_graph:
                self.graph_sizes = batch_sizes(cfg.cuda_graph_max_bs, cfg.cuda_graph_batch_sizes,
                                               cfg.max_running)
            else:
                log.warning("CUDA graphs off: the %s attention backend cannot be captured",
                            type(self.attn).__name__)
        self.mem = {"weights": weight_bytes(self.model)}
        # LoRA adapters: slots reserved at their bound, the adapters given loaded now.
        self.loras: Loras | None = None
        if cfg.lora_slots:
            self.loras = Loras(self.model, cfg.lora_slots, cfg.max_lora_rank)
            self.mem["loras"] = self.loras.bytes  # allocated now: the KV's sizing sees it gone
            log.info("LoRA: %d adapter slots of rank up to %d, %.0f MiB", cfg.lora_slots, cfg.max_lora_rank,
                     self.mem["loras"] / MiB)
            for name, path in parse_specs(cfg.lora):
                a = self.loras.load(name, path)
                log.info("LoRA adapter %s (rank %d, %s) from %s: %.1f MiB", name, a.rank, ", ".join(a.targets),
                         path, a.bytes / MiB)
        if self.device.type == "cpu":
            keep_freed_blocks()  # activations reused from the heap, not page-faulted anew
        if self.device.type == "cpu" and self.dtype == torch.float32 and cpu_linear.load():
            # The C matmul kernel's panels (fp32 only); with adapters (a CausalLM's), gate and up unfused.
            self.model.pack_weights(**({"dot": cfg.quantization == "q8"} if self.loras is None
                                       else {"fuse_mlp": False}))
        if cfg.quantization == "q8" and not any(getattr(m, "packed", None) is not None and
                                                getattr(m.packed, "dot", False) for m in self.model.modules()):
            log.warning("quantization q8: %s has no Q4_0, Q4_1, Q4_K or Q8_0 matrices kept as codes: "
                        "its matmuls run in float32", model_path)
        if cfg.cuda_graph and self.device.type == "cpu":
            unrecorded = self._unrecorded()
            if unrecorded:
                log.info("CPU graphs off: %s", unrecorded)
            else:
                self.graph_sizes = cpu_batch_sizes(cfg.cuda_graph_max_bs, cfg.cuda_graph_batch_sizes,
                                                   cfg.max_running)
        self.kv: KVPool | None = None  # set by attach_kv
        self.req_to_token: ReqToTokenPool | None = None
        self.kv_tokens = 0
        self.graphs: CudaGraphRunner | None = None

    def _unrecorded(self) -> str | None:
        """Why a CPU's decode forwards cannot be recorded (cuda_graph.py), or None."""
        if self.dtype != torch.float32 or not cpu_linear.load():
            return "they need the C kernels, in float32"
        if not hasattr(self.model, "body"):
            return f"{type(self.model).__name__} has no body of C kernels to record"
        if self.tp.size > 1 or self.loras is not None:
            return "not under tensor parallel or with LoRA adapters"
        return None

    def kv_tokens_to_allocate(self) -> int:
        """The KV pool size: the configured one, else what the memory allows (under tensor
        parallel, on the rank that allows least: every rank runs this at once)."""
        if self.cfg.kv_tokens is not None:
            return self.cfg.kv_tokens
        c = self.config
        per_token = KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype)
        tokens = self._default_kv_tokens(per_token, self.cfg.kv_memory_fraction,
                                         self.cfg.max_prefill_tokens, max(self.graph_sizes, default=0))
        if self.tp.size == 1:
            return tokens
        least = torch.tensor([tokens], device=self.device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=self.tp.group)
        return int(least.item())

    def attach_kv(self, kv: KVPool, req_to_token: ReqToTokenPool) -> None:
        """Bind the KV pools (KVManager's) for forward passes, then capture the CUDA graphs,
        which hold the pools' addresses."""
        self.kv, self.req_to_token = kv, req_to_token
        self.kv_tokens = kv.allocator.total * kv.page_size
        c = self.config
        self.mem["kv"] = kv.num_slots * KVPool.bytes_per_token(c.num_layers, c.num_kv_heads,
                                                               c.head_dim, self.dtype)
        log.info("KV pool: %d tokens (%d pages of %d), %.1f MiB", self.kv_tokens,
                 kv.allocator.total, kv.page_size, self.mem["kv"] / MiB)
        sizes = self.graph_sizes
        if sizes and self.device.type == "cpu":
            t = time.perf_counter()
            try:
                self.graphs = CudaGraphRunner(self, sizes)
            except (cpu_graph.NotRecordable, NotImplementedError) as e:
                log.info("CPU graphs off: %s", e)
                return
            self.mem["graphs"] = self.graphs.nbytes
            log.info("CPU graphs: %d decode batch sizes up to %d, each recorded by its first "
                     "batch; their arena sized in %.1f s: %.1f MiB", len(sizes), sizes[-1],
                     time.perf_counter() - t, self.mem["graphs"] / MiB)
        elif sizes:
            torch.cuda.empty_cache()  # capture empties the cache too: do it before measuring
            free = torch.cuda.mem_get_info(self.device)[0]
            t = time.perf_counter()
            self.graphs = CudaGraphRunner(self, sizes)
            self.mem["graphs"] = free - torch.cuda.mem_get_info(self.device)[0]
            log.info("CUDA graphs: %d batch sizes up to %d captured in %.1f s, %.1f MiB",
                     len(sizes), sizes[-1], time.perf_counter() - t, self.mem["graphs"] / MiB)

    def _default_kv_tokens(self, per_token: int, fraction: float, max_prefill_tokens: int,
                           graph_bs: int) -> int:
        if self.device.type != "cuda":
            tokens, why = cpu_kv_tokens(per_token, self.cfg.max_running, self.max_context,
                                        available_memory())
            log.info("KV pool on the CPU: %d tokens (%.2f GiB, taken as used): %s", tokens,
                     tokens * per_token / GiB, why)
            return tokens
        dev = self.device
        ps = self.cfg.page_size
        torch.cuda.synchronize(dev)
        # Temporary pools just big enough for the warm-up batch.
        kv = KVPool(self.config.num_layers, math.ceil(max_prefill_tokens / ps) + 1, ps,
                    self.config.num_kv_heads, self.config.head_dim, self.dtype, dev)
        rtt = ReqToTokenPool(self.cfg.max_running + 1, self.max_context, dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        self._warmup(kv, rtt, max_prefill_tokens)
        self.mem["activations"] = torch.cuda.max_memory_allocated(dev) - base
        self.mem["graphs_estimate"] = 0
        if graph_bs:
            torch.cuda.reset_peak_memory_stats(dev)
            probe = CudaGraphRunner(self, [graph_bs], capture=False, kv=kv, req_to_token=rtt)
            probe.forward(graph_bs)  # every row padding, as at capture
            torch.cuda.synchronize(dev)
            self.mem["graphs_estimate"] = torch.cuda.max_memory_allocated(dev) - base
            del probe
        # The request-to-token table KVManager allocates next is as big as this one.
        table_bytes = rtt.table.numel() * rtt.table.element_size()
        del kv, rtt
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(dev)[0]
        spare = free - table_bytes - self.mem["activations"] - self.mem["graphs_estimate"]
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
    def _warmup(self, kv: KVPool, rtt: ReqToTokenPool, num_tokens: int) -> None:
        """One EXTEND forward of num_tokens new tokens (prompts of up to max_context tokens,
        in rows taken from rtt and given back), with logits for every token."""
        ps, table = kv.page_size, rtt.table
        # No step holds more than max_running prompts of at most max_context tokens.
        num_tokens = min(num_tokens, rtt.num_free * self.max_context)
        lens = [min(self.max_context, num_tokens - i)
                for i in range(0, num_tokens, self.max_context)]
        rows = [rtt.alloc() for _ in lens]
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
            rtt.free(row)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [len(fb.logits_idx), vocab] in float32: from a CUDA graph for a decode
        batch that fits one (a view valid until the next forward), else eagerly."""
        if self.ranks is None:
            return self._forward(fb)
        self.ranks.send(fb)  # the followers run it beside this one (ranks.py)
        try:
            return self._forward(fb)
        except Exception as e:  # the group cannot go on: it ends, naming the cause
            raise self.ranks.fail(e) from e

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        if self.graphs is not None and fb.lora is None and self.graphs.can_run(fb):
            return self.graphs.run(fb)  # (captured without adapters: a batch with them runs eagerly)
        return self.forward_eager(fb)

    @torch.inference_mode()
    def forward_eager(self, fb: ForwardBatch) -> torch.Tensor:
        fb.attn, fb.attn_meta = self.attn, self.attn.prepare(fb)
        if self.loras is None:
            return self.run_model(fb)
        self.loras.current = fb.lora
        try:
            return self.run_model(fb)
        finally:
            self.loras.current = None

    def close(self) -> None:
        """Stop the followers, if any (rank 0)."""
        if self.ranks is not None:
            ranks, self.ranks = self.ranks, None
            ranks.close()

    def abort(self, e: BaseException) -> BaseException:
        """After setting up failed on rank 0 with e: the followers killed, and what to raise:
        e, or the exit of a follower that caused it (a collective's failure is a plain
        RuntimeError; rank 0's own errors, a bad config's ValueError, are said as they are)."""
        if self.ranks is None:
            return e
        ranks, self.ranks = self.ranks, None
        why = ranks.exited(wait=2.0) if type(e) is RuntimeError else None
        ranks.close(failed=True)
        if why is None:
            return e
        why.__cause__ = e
        return why

    def run_model(self, fb: ForwardBatch) -> torch.Tensor:
        """The model and its logits on a batch whose attention metadata is prepared (eagerly,
        or once for a CUDA graph's static batch)."""
        hidden = self.model(fb.input_ids, fb.positions, fb)
        return self.model.logits(hidden[fb.logits_idx])
