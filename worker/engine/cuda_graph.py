"""CUDA graphs for decode: one captured forward pass (model + logits, not sampling) per batch size.

A decode batch of B requests runs as the smallest captured size bs >= B. Its inputs are copied
into static buffers; rows B..bs are padding: token 0 at position 0, seq_len 1, out_cache_loc 0
and req_pool_idx = the runner's scratch row, whose slots are all 0, so padded rows write and
read only slot 0 of the scratch page, never a request's KV. Larger batches and EXTEND batches
run eagerly. All graphs share one memory pool (captured largest first, so the smaller ones reuse
its blocks) and write their logits into one static buffer, so graph memory is about one decode
forward at the largest size plus that buffer.

On a CPU (fp32, the C kernels) the same runner records each size's forward instead
(kernels/cpu_graph.py): the model's body and logits as a list of C kernel calls, replayed in one
call after the step's embeddings and RoPE angles are written into the recording's inputs. A
size is recorded by its first batch, as that batch runs; every size from 1 up may be (a padded
row costs its compute on a CPU), to CPU_MAX_BS by default, where the Python between kernels has
become a small part of a step. All sizes' intermediates share one arena (cpu_graph.Arena), sized
at start-up by recording the largest size once.

Without capture `run` pads the same way and runs the padded batch eagerly; the tests check the
padding through that path.
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from .batch import ForwardBatch, ForwardMode
from .kernels import cpu_graph
from .kv_pool import KVPool, ReqToTokenPool

if TYPE_CHECKING:
    from .model_runner import ModelRunner

# Rows of the static input buffer, in order.
FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "prefix_lens")


def batch_sizes(max_bs: int | None, sizes: list[int] | None, max_running: int) -> list[int]:
    """The sizes to capture: `sizes` if given, else 1, 2, 4 and every multiple of 8 up to
    max_bs (default: max_running, at most 256). Raises ValueError naming the bad option."""
    if max_bs is not None and max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs: must be >= 1, got {max_bs}")
    if max_bs is not None and max_bs > max_running:
        raise ValueError(f"cuda_graph_max_bs: {max_bs} exceeds max_running {max_running} "
                         "(no batch gets that big)")
    if sizes is not None:
        sizes = sorted(set(sizes))
        if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"cuda_graph_batch_sizes: expected positive ints, got {sizes}")
        limit = max_bs if max_bs is not None else max_running
        if sizes[-1] > limit:
            name = "cuda_graph_max_bs" if max_bs is not None else "max_running"
            raise ValueError(f"cuda_graph_batch_sizes: {sizes[-1]} exceeds {name} {limit}")
        return sizes
    if max_bs is None:
        max_bs = min(max_running, 256)
    return sorted({s for s in (1, 2, 4, *range(8, max_bs + 1, 8)) if s <= max_bs} | {max_bs})


# The largest decode batch recorded on a CPU by default. SmolLM2-135M's Q4_1 codes on a 2-core
# x86 (bench/roofline.py --eager): a replayed step 1.69x faster than eager at batch 1, 1.19x
# at 16; the arena grows with the largest size (14 MiB at 16).
CPU_MAX_BS = 16


def cpu_batch_sizes(max_bs: int | None, sizes: list[int] | None, max_running: int) -> list[int]:
    """The sizes to record on a CPU: `sizes` if given, else every size from 1 to max_bs
    (default: CPU_MAX_BS, at most max_running). Checked as batch_sizes checks them."""
    if sizes is not None:
        return batch_sizes(max_bs, sizes, max_running)
    batch_sizes(max_bs, None, max_running)
    return list(range(1, min(max_bs or CPU_MAX_BS, max_running) + 1))


def pick_size(sizes: list[int], n: int) -> int | None:
    """The smallest of the sorted `sizes` that holds n rows, or None if none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner, sizes: list[int], capture: bool = True,
                 kv: KVPool | None = None, req_to_token: ReqToTokenPool | None = None):
        """runner: the ModelRunner (model, attention backend); kv and req_to_token: the pools
        the graphs bind (default: the runner's; start-up sizing passes temporary ones)."""
        self.runner = runner
        self.sizes = sorted(sizes)
        self.max_bs = self.sizes[-1]
        dev = runner.device
        rtt = req_to_token or runner.req_to_token
        self.buf = torch.zeros(len(FIELDS), self.max_bs, dtype=torch.int64, device=dev)
        self.pad = torch.tensor([0, 0, 0, rtt.scratch_row, 1, 0], dtype=torch.int64,
                                device=dev)[:, None]  # a padded row's value of each field
        self.buf[:] = self.pad
        self.ones = torch.ones(self.max_bs, dtype=torch.int64, device=dev)
        self.arange = torch.arange(self.max_bs, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(self.max_bs, runner.config.vocab_size, dtype=torch.float32,
                                  device=dev)
        self.batches = {bs: self._batch(bs, kv or runner.kv, rtt) for bs in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # On a CPU: each size's recording, and its inputs (embeddings, RoPE's cos and sin).
        self.recordings: dict[int, tuple[cpu_graph.Recording, torch.Tensor, tuple]] = {}
        self.arena: cpu_graph.Arena | None = None
        if capture:
            self._capture() if dev.type == "cuda" else self._record()

    def _batch(self, bs: int, kv: KVPool, rtt: ReqToTokenPool) -> ForwardBatch:
        """The static ForwardBatch of size bs: views of the shared buffers."""
        f = {name: self.buf[i, :bs] for i, name in enumerate(FIELDS)}
        return ForwardBatch(
            mode=ForwardMode.DECODE, **f, extend_lens=self.ones[:bs],
            extend_start_loc=self.arange[:bs], seq_lens_cpu=[1] * bs, prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs, req_to_token=rtt.table, kv=kv,
            logits_idx=self.arange[:bs])

    def forward(self, bs: int) -> None:
        """Run the static batch of size bs eagerly; its logits land in self.logits[:bs]."""
        self.logits[:bs].copy_(self.runner.forward_eager(self.batches[bs]))

    def _capture(self) -> None:
        # Capture with every row padding; a warm-up run first compiles the Triton kernels
        # and lets cuBLAS pick its kernels outside the capture. The attention metadata is
        # made once per size (the backend's capture hook) and refreshed before each replay.
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        attn = self.runner.attn
        for bs in reversed(self.sizes):
            self.forward(bs)
            torch.cuda.synchronize()
            sb = self.batches[bs]
            sb.attn, sb.attn_meta = attn, attn.prepare_capture(sb)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.logits[:bs].copy_(self.runner.run_model(sb))
            self.graphs[bs] = g
        torch.cuda.synchronize()

    def _record(self) -> None:
        # The arena every size's recording allocates from, as big as the largest size's
        # allocations: measured by recording it once (its static batch all padding), which also
        # says at start-up whether the model can be recorded (cpu_graph.NotRecordable if not).
        self.arena = cpu_graph.Arena(self._recorded(self.max_bs, None)[0].used)

    def _recorded(self, bs: int, arena: cpu_graph.Arena | None) -> tuple:
        """The static batch of size bs, its body and logits recorded as they run on the inputs in
        its buffers now; with the input tensors the recording reads (embeddings, RoPE's cos and
        sin), which replays refresh."""
        model, attn, sb = self.runner.model, self.runner.attn, self.batches[bs]
        sb.attn, sb.attn_meta = attn, attn.prepare_capture(sb)
        h = model.embed_tokens(sb.input_ids).contiguous()
        rope = tuple(t.contiguous() for t in model.rope(sb.positions, h.dtype))
        return cpu_graph.record(lambda: model.logits(model.body(h, rope, sb)), arena), h, rope

    @property
    def nbytes(self) -> int:
        """The recordings' memory (their intermediates and logits) on a CPU."""
        return self.arena.buf.numel() + sum(rec.nbytes for rec, _, _ in self.recordings.values())

    def _replay(self, bs: int) -> torch.Tensor:
        """The static batch of size bs's logits: its recording replayed, its inputs refreshed; a
        size's first batch is recorded as it runs (sizes never used cost nothing)."""
        if bs not in self.recordings:
            self.recordings[bs] = self._recorded(bs, self.arena)
            return self.recordings[bs][0].out
        model, sb = self.runner.model, self.batches[bs]
        rec, h, rope = self.recordings[bs]
        h.copy_(model.embed_tokens(sb.input_ids))
        for t, new in zip(rope, model.rope(sb.positions, h.dtype)):
            t.copy_(new)
        rec.replay()
        return rec.out

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.mode == ForwardMode.DECODE and fb.batch_size <= self.max_bs

    def load(self, fb: ForwardBatch) -> int:
        """Copy fb's inputs into the static buffers and pad; returns the padded size."""
        n = fb.batch_size
        bs = pick_size(self.sizes, n)
        for row, name in zip(self.buf, FIELDS):
            row[:n].copy_(getattr(fb, name))
        if bs > n:
            self.buf[:, n:bs] = self.pad
        sb = self.batches[bs]
        # Only the eager path reads the host lists (the torch backend's prepare does).
        sb.seq_lens_cpu = fb.seq_lens_cpu + [1] * (bs - n)
        sb.prefix_lens_cpu = fb.prefix_lens_cpu + [0] * (bs - n)
        return bs

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [len(fb.logits_idx), vocab] float32, a view of the static buffer: valid
        until the next run."""
        n = fb.batch_size
        bs = self.load(fb)
        if self.graphs:
            sb = self.batches[bs]
            self.runner.attn.prepare_replay(sb, sb.attn_meta)
            self.graphs[bs].replay()
            out = self.logits[:n]
        elif self.arena is not None:
            out = self._replay(bs)[:n]
        else:
            self.forward(bs)
            out = self.logits[:n]
        # In decode every row wants its logits, except a 1-token chunk of a longer prompt.
        return out if fb.logits_idx.shape[0] == n else out[fb.logits_idx]
