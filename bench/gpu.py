"""The GPU check, in one command: kernels on the device, greedy output with CUDA graphs on ==
graphs off == transformers, decode step time per batch size with and without graphs, memory
bandwidth per decode step, throughput against transformers `generate`, and the model with
8-bit weights (int8, fp8 where the GPU has it) against itself in the dtype, and the
model split over 2 GPUs (tensor parallel, NCCL) against it on one, where there are 2.

    python bench/gpu.py                      # CUDA: a Qwen2.5-0.5B-shaped random model, bf16
    python bench/gpu.py --dry-run            # CPU: a tiny model through the same code paths

Writes <out>/gpu.json (every figure) and <out>/gpu.md (the tables); --out defaults to
bench/out/gpu. Exits 1 when a correctness check fails (kernels, greedy output) or a section
raises; the speed targets are reported, not enforced.

Greedy comparisons in bf16 tolerate near-ties: where two outputs first differ, transformers'
teacher-forced logits at that position must rate both tokens within --tie-tol logit standard
deviations of each other, otherwise it is a mismatch. Bytes per decode step = all weights read
once (the tied embedding is the lm_head) + every request's KV read once.
On a CPU (--dry-run) nothing is captured: the "graphs" arm runs the graph runner's padded
static-buffer path eagerly, and the figures are not meaningful.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import statistics
import sys
import time
import traceback

import torch

if "--dry-run" in sys.argv or not torch.cuda.is_available():  # Triton on a CPU: interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import triton  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from bench.engine import run_ours, toy_a  # noqa: E402
from worker.engine import Engine, SamplingParams  # noqa: E402
from worker.engine.batch import ForwardBatch, ForwardMode  # noqa: E402
from worker.engine.cuda_graph import CudaGraphRunner, batch_sizes  # noqa: E402
from worker.engine.kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from worker.engine.kernels.extend_attention import extend_attention, extend_attention_ref  # noqa: E402
from worker.engine.kernels.lora import lora_add, lora_ref  # noqa: E402
from worker.engine.kernels.store_kv import store_kv, store_kv_ref  # noqa: E402
from worker.engine.kernels import w8_linear  # noqa: E402
from worker.engine.kv_pool import KVPool  # noqa: E402
from worker.engine.models.config import MoEConfig  # noqa: E402
from worker.engine.models.moe import MoE  # noqa: E402
from worker.engine.models.qwen2_vl import repeat_frames  # noqa: E402
from worker.engine.models.tiny import build_tiny_model, build_tiny_qwen2_vl  # noqa: E402

# The attention kernels' variants checked: full attention; a sliding window (Mistral's kind)
# across their key blocks, not a multiple of them; and with scores soft-capped (Gemma 2's).
VARIANTS = ((0, 0.0), (37, 0.0), (37, 5.0))


def _variant(window: int, softcap: float) -> str:
    return (f" window {window}" if window else "") + (f" softcap {softcap:g}" if softcap else "")


# HBM peak by device name, bytes/s (SXM parts); --peak-tbs overrides.
NOMINAL_PEAK = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}

FULL = dict(
    model=dict(arch="qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
               intermediate_size=4864, vocab_size=151936, max_context=32768,
               tie_word_embeddings=True, dtype=torch.bfloat16,  # Qwen2.5-0.5B's shape
               weight_scale=1.0),  # gain 1 per projection: bf16 noise is not amplified much
    dtype="bf16", kv_memory_fraction=0.5,
    kernel_dtypes=(torch.bfloat16, torch.float16), kernel_heads=((14, 2, 64), (32, 8, 128)),
    decode_lens=[1, 17, 300, 1024, 3000], extend=([0, 100, 2000, 0], [1000, 1, 300, 64]),
    greedy_prompts=12, greedy_len=(16, 300), greedy_new=(16, 32),
    step_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256], step_ctx=1024, long_point=(256, 4096),
    step_iters=30, items=256, hf_batch=64, copy_bytes=2**31,
    overhead_sizes=[8, 64, 256], overhead_new=48)
DRY = dict(
    model=dict(arch="qwen2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
               intermediate_size=128, vocab_size=512, max_context=1024, tie_word_embeddings=True),
    dtype="fp32", kv_memory_fraction=0.5,
    kernel_dtypes=(torch.float32, torch.float16), kernel_heads=((4, 2, 32),),
    decode_lens=[1, 19, 70], extend=([0, 13, 40], [70, 1, 5]),
    greedy_prompts=3, greedy_len=(5, 40), greedy_new=(4, 8),
    step_sizes=[1, 2, 3], step_ctx=32, long_point=(3, 64),
    step_iters=2, items=3, hf_batch=2, copy_bytes=2**26,
    overhead_sizes=[2, 3], overhead_new=6)
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 1e-2), torch.bfloat16: (2e-2, 2e-2)}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# -- environment ---------------------------------------------------------------------------

def environment(dev, cfg, peak_tbs):
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    n = cfg["copy_bytes"]
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(dev)
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync(dev)
    copy_bw = 2 * n * 10 / (time.perf_counter() - t)  # read + write
    del a, b
    nominal = peak_tbs * 1e12 if peak_tbs else next(
        (v for k, v in NOMINAL_PEAK.items() if k in name), None)
    return dict(device=name, torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, copy_bw=copy_bw, nominal_peak_bw=nominal,
                peak_bw=nominal or copy_bw)


# -- kernels vs their torch references on the device ---------------------------------------

def _table(seq_lens, ps, gen, dev):
    """req_to_token rows for requests of these lengths on shuffled pages (never page 0)."""
    need = [math.ceil(n / ps) for n in seq_lens]
    pages = (torch.randperm(sum(need) + 4, generator=gen) + 1).tolist()
    rows = torch.randperm(len(seq_lens) + 2, generator=gen)[:len(seq_lens)]
    table = torch.zeros(len(seq_lens) + 2, max(seq_lens), dtype=torch.int64)
    for row, n, k in zip(rows.tolist(), seq_lens, need):
        mine = torch.tensor([pages.pop() for _ in range(k)])
        table[row, :n] = (mine[:, None] * ps + torch.arange(ps)).flatten()[:n]
    return table.to(dev), rows.to(dev), (sum(need) + 5) * ps


def _close(out, ref, dtype, scale=None):
    """Within the dtype's tolerance of ref, elementwise, or of `scale` where given (a matmul's
    output near 0 is a sum of large products, rounded in some order: its error scales with
    those, not with it)."""
    atol, rtol = TOL[dtype]
    err = (out.float() - ref.float()).abs()
    bound = ref.float().abs() if scale is None else scale
    return dict(max_err=err.max().item(), ok=bool((err <= atol + rtol * bound).all()))


def kernel_checks(dev, cfg):
    rows = []
    gen = torch.Generator().manual_seed(0)
    for dtype in cfg["kernel_dtypes"]:
        for hq, hkv, d in cfg["kernel_heads"]:
            for ps in (1, 16):
                tag = dict(dtype=str(dtype).removeprefix("torch."), heads=f"{hq}/{hkv}x{d}", page=ps)

                def rand(*shape):
                    return torch.randn(*shape, generator=gen).to(dev, dtype)

                lens = cfg["decode_lens"]
                table, rr, slots = _table(lens, ps, gen, dev)
                kb, vb = rand(slots, hkv, d), rand(slots, hkv, d)
                q = rand(len(lens), hq, d)
                seq = torch.tensor(lens, device=dev)
                for w, cap in VARIANTS:
                    out = decode_attention(q, kb, vb, table, rr, seq, d ** -0.5, window=w, softcap=cap)
                    ref = decode_attention_ref(q, kb, vb, table, rr, seq, d ** -0.5, window=w, softcap=cap)
                    rows.append(dict(kernel="decode_attention" + _variant(w, cap), **tag,
                                     **_close(out, ref, dtype)))

                prefix, ext = cfg["extend"]
                seq_lens = [p + n for p, n in zip(prefix, ext)]
                table, rr, slots = _table(seq_lens, ps, gen, dev)
                kb, vb = rand(slots, hkv, d), rand(slots, hkv, d)
                q = rand(sum(ext), hq, d)
                e = torch.tensor(ext, device=dev)
                args = (q, kb, vb, table, rr, torch.tensor(seq_lens, device=dev), torch.cumsum(e, 0) - e, e)
                for w, cap in VARIANTS:
                    out = extend_attention(*args, max(ext), d ** -0.5, window=w, softcap=cap)
                    ref = extend_attention_ref(*args, d ** -0.5, window=w, softcap=cap)
                    rows.append(dict(kernel="extend_attention" + _variant(w, cap), **tag,
                                     **_close(out, ref, dtype)))

                loc = table[rr[2], :seq_lens[2]]
                kv = torch.randn(len(loc), 2, hkv, d, generator=gen).to(dev)  # fp32 views, strided
                kr, vr = kb.clone(), vb.clone()
                store_kv(kv[:, 0], kv[:, 1], kb, vb, loc)
                store_kv_ref(kv[:, 0], kv[:, 1], kr, vr, loc)
                ok = torch.equal(kb, kr) and torch.equal(vb, vr)
                rows.append(dict(kernel="store_kv", **tag, max_err=0.0 if ok else float("nan"), ok=ok))
        # Batched LoRA (kernels/lora.py): tokens of 3 adapters and the base, a [384 x 256]
        # projection of 3 sub-projections at rank 16 (B block-diagonal, as lora.py stacks it).
        r, k, n = 16, 256, 384
        slots = torch.tensor([1, 0, 3, 2, 1, 0, 3, 3], dtype=torch.int32, device=dev)
        x, out = (torch.randn(8, k, generator=gen).to(dev, dtype), torch.randn(8, n, generator=gen).to(dev, dtype))
        a = torch.randn(4, 3 * r, k, generator=gen).to(dev, dtype) * 0.1
        b = torch.randn(4, n, 3 * r, generator=gen).to(dev, dtype) * 0.1
        got = lora_add(x, out.clone(), a, b, slots)
        ref = lora_ref(x, out.clone(), a, b, slots)
        rows.append(dict(kernel="lora_add", dtype=str(dtype).removeprefix("torch."), heads="3 subs, r16",
                         page=0, **_close(got, ref, dtype)))
        # A mixture of experts' grouped matmuls (kernels/fused_moe.py) against the loop over
        # experts (models/moe.py), the same routing: 100 tokens, 8 experts, 2 a token.
        moe = MoE(MoEConfig(8, 2, 256, True, (0,), False), hidden_size=128)
        with torch.no_grad():
            for p in moe.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        moe = moe.to(dev, dtype)
        x = torch.randn(100, 128, generator=gen).to(dev, dtype)
        with torch.inference_mode():
            route = moe.route(x)
            got, ref = moe.fused(x, *route), moe.loop(x, *route)
        rows.append(dict(kernel="fused_moe", dtype=str(dtype).removeprefix("torch."), heads="8 experts, top 2",
                         page=0, **_close(got, ref, dtype)))
        # 8-bit weights (kernels/w8_linear.py) against x times the dequantized weight: int8,
        # and fp8 where the GPU has e4m3 (not in the interpreter).
        w = torch.randn(300, 256, generator=gen)
        x = torch.randn(37, 256, generator=gen).to(dev, dtype)
        for fmt in ("int8", "fp8") if fp8_ok(dev) else ("int8",):
            q = w8_linear.quantize(w, fmt)
            q = w8_linear.W8(q.q.to(dev), q.scale.to(dev))
            ref = (x.float() @ q.dequantize().T).to(dtype)
            rows.append(dict(kernel=f"w8_linear {fmt}", dtype=str(dtype).removeprefix("torch."), heads="300 x 256",
                             page=0, **_close(w8_linear.linear(x, q), ref, dtype,
                                              scale=x.float().abs() @ q.dequantize().abs().T)))
    sync(dev)
    return rows


# -- model, engine, transformers -----------------------------------------------------------

def fp8_ok(dev) -> bool:
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9)


def eight_bit(engine, model_dir, cfg, vocab, dev):
    """Every linear layer in int8 (and fp8 where the GPU has it) against the same model in
    the dtype: greedy tokens (count equal, where the first differs) and eager decode step
    times at batch 1 and 8, with the weights' bytes."""
    if dev.type != "cuda":
        return dict(skipped="8-bit weights run on a GPU")
    batch = prompts(8, 16, 64, vocab, seed=11)
    want = greedy_ours(engine, batch, [32] * len(batch))

    def steps(e):
        out = {}
        for bs in (1, 8):
            fb, release = synthetic_decode(e, bs, 512)
            try:
                out[bs] = timed(lambda: e.runner.forward_eager(fb), cfg["step_iters"], dev) * 1e3
            finally:
                release()
        return out

    rows = [dict(format=cfg["dtype"], weights_mb=engine.runner.mem["weights"] / 1e6, step_ms=steps(engine))]
    for fmt in ("int8", "fp8") if fp8_ok(dev) else ("int8",):
        e = Engine(model_dir, device="cuda", dtype=cfg["dtype"], quantization=fmt, kv_tokens=16384,
                   cuda_graph=False)
        got = greedy_ours(e, batch, [32] * len(batch))
        firsts = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, want)]
        rows.append(dict(format=fmt, weights_mb=e.runner.mem["weights"] / 1e6, step_ms=steps(e),
                         equal=f"{sum(f is None for f in firsts)}/{len(batch)}",
                         first_differ=[f for f in firsts if f is not None]))
        del e
        torch.cuda.empty_cache()
    return dict(rows=rows)


def tensor_parallel(engine, model_dir, cfg, vocab, dev):
    """The model split over 2 ranks (on 2 GPUs: NCCL, each rank capturing its CUDA graphs; in
    a dry run: gloo on the CPU) against the engine on one: greedy tokens (count equal, where
    the first differs) and the same batch's tok/s, each engine warmed up first."""
    if dev.type == "cuda" and torch.cuda.device_count() < 2:
        return dict(skipped=f"{torch.cuda.device_count()} GPU here: tensor parallel needs 2")
    batch, new = prompts(8, 16, 64, vocab, seed=13), 32

    def run(e):
        greedy_ours(e, batch, [4] * len(batch))
        t = time.perf_counter()
        out = greedy_ours(e, batch, [new] * len(batch))
        sync(dev)
        return out, len(batch) * new / (time.perf_counter() - t)

    want, one = run(engine)
    e = Engine(model_dir, device=dev.type, dtype=cfg["dtype"], tensor_parallel_size=2, kv_tokens=16384)
    try:
        got, two = run(e)
        graphs = e.runner.graphs is not None
    finally:
        e.close()
    firsts = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, want)]
    return dict(ranks=2, backend="nccl" if dev.type == "cuda" else "gloo", graphs=graphs,
                equal=f"{sum(f is None for f in firsts)}/{len(batch)}", first_differ=[f for f in firsts if f is not None],
                tok_s_one=one, tok_s_two=two)


def prompts(n, lo, hi, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def greedy_ours(engine, batch, max_new):
    sps = [SamplingParams(max_new_tokens=m, min_new_tokens=m, temperature=0) for m in max_new]
    engine.flush_cache()
    return [it.samples[0].token_ids for it in engine.generate(input_ids=batch, sampling_params=sps)]


@torch.no_grad()
def greedy_hf(hf, ids, m, dev):
    x = torch.tensor([ids], device=dev)
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=m, min_new_tokens=m,
                      do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@torch.no_grad()
def hf_last_logits(hf, ids, dev):
    return hf(torch.tensor([ids], device=dev)).logits[0, -1].float()


@torch.no_grad()
def hf_noise(hf, ids, dev) -> float:
    """transformers against itself: the last position's logits from one forward vs from a
    cached prefix, max difference in logit stds (the model dtype's noise at this depth)."""
    x = torch.tensor([ids], device=dev)
    full = hf(x).logits[0, -1].float()
    past = hf(x[:, :-1], use_cache=True).past_key_values
    inc = hf(x[:, -1:], past_key_values=past, use_cache=True).logits[0, -1].float()
    return ((full - inc).abs().max() / full.std()).item()


def compare(a, b, batch, hf, dev, tol):
    """Per prompt: exact, a near-tie at the first difference, or a mismatch."""
    out = dict(exact=0, near_tie=0, mismatch=0, worst_margin=0.0)
    for x, y, ids in zip(a, b, batch):
        if x == y:
            out["exact"] += 1
            continue
        j = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None)
        if j is None:  # one stopped early: not a question of near-ties
            out["mismatch"] += 1
            continue
        logits = hf_last_logits(hf, ids + x[:j], dev)
        margin = ((logits[x[j]] - logits[y[j]]).abs() / logits.std()).item()
        out["worst_margin"] = max(out["worst_margin"], margin)
        out["near_tie" if margin <= tol else "mismatch"] += 1
    return out


def greedy_check(engine, hf, graphs, cfg, vocab, dev, tol):
    batch = prompts(cfg["greedy_prompts"], *cfg["greedy_len"], vocab, seed=1)
    rng = random.Random(2)
    max_new = [rng.randrange(*cfg["greedy_new"]) for _ in batch]  # the decode batch shrinks
    runner = engine.runner
    runner.graphs = graphs
    on = greedy_ours(engine, batch, max_new)
    runner.graphs = None
    off = greedy_ours(engine, batch, max_new)
    runner.graphs = graphs
    ref = [greedy_hf(hf, ids, m, dev) for ids, m in zip(batch, max_new)]
    # Teacher-forced logits of a few prompts, relative to the logits' spread.
    engine.flush_cache()
    tf = engine.prompt_logits(batch[:3])
    rel = 0.0
    with torch.no_grad():
        for ids, (start, logits) in zip(batch[:3], tf):
            r = hf(torch.tensor([ids], device=dev)).logits[0, start:].float().cpu()
            rel = max(rel, ((logits - r).abs().max() / r.std()).item())
    noise = max(hf_noise(hf, ids, dev) for ids in batch)
    return dict(prompts=len(batch), new_tokens=sum(max_new), tie_tol=tol, logits_rel_err=rel,
                hf_self_noise=noise,
                graphs_vs_eager=compare(on, off, batch, hf, dev, tol),
                graphs_vs_hf=compare(on, ref, batch, hf, dev, tol),
                eager_vs_hf=compare(off, ref, batch, hf, dev, tol))


def synthetic_decode(engine, bs, ctx):
    """A decode batch of bs requests with ctx tokens of (stale) KV each, built on the engine's
    pools, and a function that gives the rows and pages back."""
    runner, kv = engine.runner, engine.runner.kv
    ps, table, dev = kv.page_size, runner.req_to_token.table, runner.device
    pages = kv.allocator.alloc(bs * math.ceil(ctx / ps))
    rows = [runner.req_to_token.alloc() for _ in range(bs)]
    if pages is None or None in rows:
        raise RuntimeError(f"no room for a {bs} x {ctx} decode batch")
    p = torch.tensor(pages, device=dev).view(bs, -1)
    slots = (p[:, :, None] * ps + torch.arange(ps, device=dev)).flatten(1)[:, :ctx]
    r = torch.tensor(rows, device=dev)
    table[r, :ctx] = slots
    full = torch.full((bs,), ctx, dtype=torch.int64, device=dev)
    fb = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.full((bs,), 5, device=dev), positions=full - 1,
        out_cache_loc=slots[:, -1].contiguous(), req_pool_indices=r, seq_lens=full,
        prefix_lens=full - 1, extend_lens=torch.ones_like(full),
        extend_start_loc=torch.arange(bs, device=dev), seq_lens_cpu=[ctx] * bs,
        prefix_lens_cpu=[ctx - 1] * bs, extend_lens_cpu=[1] * bs, req_to_token=table, kv=kv,
        logits_idx=torch.arange(bs, device=dev))

    def release():
        table[r] = 0
        for row in rows:
            runner.req_to_token.free(row)
        kv.allocator.free(pages)
    return fb, release


def timed(fn, iters, dev) -> float:
    """Seconds per call, synchronizing after each as the engine does (it samples every step)."""
    for _ in range(2):
        fn()
    sync(dev)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
        sync(dev)
    return (time.perf_counter() - t) / iters


def decode_steps(engine, cfg, env, dev):
    runner = engine.runner
    c = runner.config
    tied = c.tie_word_embeddings
    weights = sum(p.numel() * p.element_size() for n, p in runner.model.named_parameters()
                  if tied or not n.startswith("embed_tokens"))
    per_token = KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, runner.dtype)
    engine.flush_cache()
    rows = []
    points = [(bs, cfg["step_ctx"]) for bs in cfg["step_sizes"]] + [tuple(cfg["long_point"])]
    for bs, ctx in points:
        fb, release = synthetic_decode(engine, bs, ctx)
        try:
            eager = timed(lambda: runner.forward_eager(fb), cfg["step_iters"], dev)
            graph = timed(lambda: runner.forward(fb), cfg["step_iters"], dev)
        finally:
            release()
        moved = weights + bs * ctx * per_token
        rows.append(dict(bs=bs, ctx=ctx, eager_ms=eager * 1e3, graph_ms=graph * 1e3,
                         speedup=eager / graph, bytes=moved, graph_bw=moved / graph,
                         frac_peak=moved / graph / env["peak_bw"],
                         frac_copy=moved / graph / env["copy_bw"]))
    engine.check()
    return dict(weight_bytes=weights, kv_bytes_per_token=per_token, rows=rows)


def step_overhead(engine, cfg, vocab, dev):
    """The share of a decode step outside the model forward (scheduling, batch building,
    sampling, fan-in, events), serial and with overlap_schedule: medians over the steps
    that decode every running request, at each batch size; the greedy tokens of both ways
    compared."""
    runner, spent = engine.runner, {}
    forward = runner.forward

    def timed_forward(fb):  # on the forward thread under overlap: its own clock
        t = time.perf_counter()
        try:
            return forward(fb)
        finally:
            sync(dev)
            if fb.mode == ForwardMode.DECODE:
                spent["decode"] = spent.get("decode", 0.0) + time.perf_counter() - t
    runner.forward = timed_forward
    rows, tokens = [], {}
    try:
        for overlap in (False, True):
            engine.config.overlap_schedule = overlap
            for bs in cfg["overhead_sizes"]:
                engine.flush_cache()
                work = prompts(bs, cfg["step_ctx"] // 2, cfg["step_ctx"], vocab, seed=bs)
                # Decodes ride along while the prompts are prefilled, a chunk a step: the first
                # rows must outlive the last prefill, or no step decodes all bs rows.
                prefill_steps = -(-sum(map(len, work)) // engine.config.max_prefill_tokens)
                box = []
                engine.add("overhead", [(i, None, ids) for i, ids in enumerate(work)],
                           SamplingParams(max_new_tokens=cfg["overhead_new"] + prefill_steps, temperature=0,
                                          ignore_eos=True), sink=box.append)
                steps = []
                while engine.has_work():
                    spent.clear()
                    t = time.perf_counter()
                    engine.step()
                    if "decode" in spent and len(engine.scheduler.running) == bs:
                        steps.append((time.perf_counter() - t, spent["decode"]))
                tokens[(overlap, bs)] = sorted((e.index, e.token_ids) for e in box if e.finished)
                if not steps:
                    raise RuntimeError(f"no decode step ran all {bs} rows (overlap={overlap})")
                step = statistics.median(s for s, _ in steps)
                fwd = statistics.median(f for _, f in steps)
                rows.append(dict(overlap=overlap, bs=bs, steps=len(steps), step_ms=step * 1e3,
                                 forward_ms=fwd * 1e3, not_forward=max(0.0, 1 - fwd / step)))
    finally:
        runner.forward = forward
        engine.config.overlap_schedule = False
    same = all(tokens[(True, bs)] == tokens[(False, bs)] for bs in cfg["overhead_sizes"])
    return dict(rows=rows, same_tokens=same)


@torch.no_grad()
def run_hf(hf, work, batch, dev) -> float:
    """transformers generate in static chunks of `batch`, left-padded (as bench/engine.py)."""
    sync(dev)
    t = time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i:i + batch]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.tensor([[0] * (width - len(x)) + x for x, _ in chunk], device=dev)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x, _ in chunk], device=dev)
        new = max(o for _, o in chunk)
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, pad_token_id=0)
    sync(dev)
    return time.perf_counter() - t


def throughput(engine, hf, cfg, vocab, dev):
    work = toy_a(vocab, random.Random(0), cfg["items"])
    warm = [(ids, 8) for ids, _ in work[:2]]
    run_ours(engine, warm, 1)
    run_hf(hf, warm, 2, dev)
    engine.flush_cache()
    t_ours, _, _ = run_ours(engine, work, 1)
    t_hf = run_hf(hf, work, cfg["hf_batch"], dev)
    out = sum(o for _, o in work)
    return dict(items=len(work), hf_batch=cfg["hf_batch"], out_tokens=out,
                prompt_tokens=sum(len(ids) for ids, _ in work), ours_s=t_ours, hf_s=t_hf,
                ours_tok_s=out / t_ours, hf_tok_s=out / t_hf, ratio=t_hf / t_ours)


# -- images --------------------------------------------------------------------------------

def vision_check(dev, model_dir) -> dict:
    """A tiny Qwen2-VL on the device in fp32 (its vision tower, M-RoPE's three position rows,
    prefill chunks that cut images through the extend kernel, graphs for decode): greedy
    tokens of chats with 0 to 3 images equal transformers' on the same weights and inputs."""
    import base64
    import io

    from PIL import Image as PILImage
    from transformers import Qwen2VLForConditionalGeneration

    path = build_tiny_qwen2_vl(model_dir)
    engine = Engine(path, device=dev.type, dtype="fp32", max_prefill_tokens=16, kv_memory_fraction=0.1)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).to(dev).eval()
    mc = engine.runner.config
    g = torch.Generator().manual_seed(0)

    def url(w, h):
        buf = io.BytesIO()
        pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
        PILImage.fromarray(pixels).save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    urls = [url(w, h) for w, h in ((40, 28), (28, 61), (100, 75))]
    chats = [[{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls[:k]),
                                           {"type": "text", "text": f"{k} images"}]}] for k in range(4)]
    new = 8
    sp = SamplingParams(max_new_tokens=new, min_new_tokens=new, temperature=0)
    out = engine.generate(messages=chats, sampling_params=sp)
    exact = 0
    for chat, item in zip(chats, out):
        ids, spans = engine.front.chats.encode(chat)
        # transformers' inputs from ours: image positions hold its image token, not our pad ids.
        x = torch.tensor([[mc.vision.image_token_id if t >= mc.vocab_size else t for t in ids]], device=dev)
        kw = {}
        if spans:
            m = mc.vision.merge_size
            px = repeat_frames(torch.cat([s.image.pixels for s in spans]), mc.vision.temporal_patch_size)
            kw = dict(pixel_values=px.to(dev),
                      image_grid_thw=torch.tensor([[t, h * m, w * m] for t, h, w in (s.image.grid for s in spans)],
                                                  device=dev),
                      mm_token_type_ids=(x == mc.vision.image_token_id).int())
        with torch.no_grad():
            ref = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0, **kw)
        exact += ref[0, x.shape[1]:].tolist() == item.samples[0].token_ids
    engine.check()
    return dict(chats=len(chats), images=[len(c[0]["content"]) - 1 for c in chats], exact=exact)


# -- report --------------------------------------------------------------------------------

def targets(res):
    steps = res.get("decode_steps", {}).get("rows", [])
    bs1 = next((r for r in steps if r["bs"] == 1), None)
    big = [r for r in steps if r["bs"] >= 64] or steps
    best = max(big, key=lambda r: r["frac_peak"], default=None)
    tp = res.get("throughput", {})
    return dict(
        graph_speedup_bs1=dict(value=bs1 and bs1["speedup"], target=2.0,
                               met=bool(bs1 and bs1["speedup"] >= 2.0)),
        large_batch_bw_frac=dict(value=best and best["frac_peak"], at=best and [best["bs"], best["ctx"]],
                                 target=0.6, met=bool(best and best["frac_peak"] >= 0.6)),
        throughput_vs_hf=dict(value=tp.get("ratio"), target=10.0, met=tp.get("ratio", 0) >= 10.0))


PAIRS = ("graphs_vs_eager", "graphs_vs_hf", "eager_vs_hf")


def correct(res) -> bool:
    k, g, v = res.get("kernels"), res.get("greedy"), res.get("vision")
    o = res.get("step_overhead")
    return bool(k and all(r["ok"] for r in k) and g and all(g[p]["mismatch"] == 0 for p in PAIRS)
                and v and v["exact"] == v["chats"] and o and o["same_tokens"])


def table(res) -> str:
    env, t = res.get("env", {}), res.get("targets", {})
    kind = "dry run, figures not meaningful" if res["dry_run"] else "measured"
    lines = [f"# GPU check: {env.get('device')} ({kind})", "",
             f"torch {env.get('torch')}, triton {env.get('triton')}, "
             f"transformers {env.get('transformers')}; copy bandwidth {env.get('copy_bw', 0) / 1e12:.2f} TB/s; "
             f"peak used {env.get('peak_bw', 0) / 1e12:.2f} TB/s",
             "", "| check | result | target |", "|---|---|---|"]
    row = lines.append
    if "kernels" in res:
        k = res["kernels"]
        row(f"| kernels vs torch references on the device | {sum(r['ok'] for r in k)}/{len(k)} ok | all |")
    if "greedy" in res:
        g = res["greedy"]
        for p in PAIRS:
            c = g[p]
            row(f"| greedy {p.replace('_', ' ')} ({g['prompts']} prompts) | {c['exact']} exact, "
                f"{c['near_tie']} near-tie, {c['mismatch']} mismatch | no mismatch |")
        row(f"| teacher-forced logits vs transformers | max err {g['logits_rel_err']:.3f} std "
            f"(transformers vs itself, cached: {g['hf_self_noise']:.3f}) | - |")
    if "vision" in res:
        v = res["vision"]
        row(f"| Qwen2-VL greedy vs transformers, fp32 (chats with {v['images']} images) | "
            f"{v['exact']}/{v['chats']} exact | all |")
    if t.get("graph_speedup_bs1", {}).get("value"):
        row(f"| decode step speed-up from graphs, batch 1 | {t['graph_speedup_bs1']['value']:.2f}x | >= 2x |")
    if t.get("large_batch_bw_frac", {}).get("value"):
        b = t["large_batch_bw_frac"]
        row(f"| best large-batch bandwidth (bs {b['at'][0]}, ctx {b['at'][1]}) | "
            f"{b['value']:.0%} of peak | >= 60% |")
    if "throughput" in res:
        tp = res["throughput"]
        row(f"| throughput vs transformers generate ({tp['items']} items, hf batch {tp['hf_batch']}) | "
            f"{tp['ours_tok_s']:.0f} vs {tp['hf_tok_s']:.0f} tok/s = {tp['ratio']:.1f}x | >= 10x |")
    if "startup" in res:
        s = res["startup"]
        mem = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in s["mem"].items())
        lines += ["", f"Start-up {s['seconds']:.1f} s; KV pool {s['kv_tokens']} tokens; graphs for "
                      f"{len(s['graph_sizes'])} batch sizes; memory (MiB): {mem}"]
    if "decode_steps" in res:
        lines += ["", "| batch | context | eager ms | graph ms | speed-up | MB/step | TB/s | % peak |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in res["decode_steps"]["rows"]:
            row(f"| {r['bs']} | {r['ctx']} | {r['eager_ms']:.3f} | {r['graph_ms']:.3f} | "
                f"{r['speedup']:.2f}x | {r['bytes'] / 1e6:.0f} | {r['graph_bw'] / 1e12:.3f} | "
                f"{r['frac_peak']:.0%} |")
    if "step_overhead" in res:
        o = res["step_overhead"]
        lines += ["", f"Decode steps outside the forward (greedy tokens with overlap = serial: "
                      f"{o['same_tokens']}):", "",
                  "| overlap | batch | step ms | forward ms | not forward |", "|---|---|---|---|---|"]
        for r in o["rows"]:
            row(f"| {'on' if r['overlap'] else 'off'} | {r['bs']} | {r['step_ms']:.2f} | "
                f"{r['forward_ms']:.2f} | {r['not_forward']:.1%} |")
    if res.get("eight_bit", {}).get("rows"):
        lines += ["", "8-bit weights (eager decode steps at context 512):", "",
                  "| weights | MB | bs 1 ms | bs 8 ms | greedy = dtype's | first differ at |",
                  "|---|---|---|---|---|---|"]
        for r in res["eight_bit"]["rows"]:
            row(f"| {r['format']} | {r['weights_mb']:.0f} | {r['step_ms'][1]:.3f} | {r['step_ms'][8]:.3f} | "
                f"{r.get('equal', '-')} | {r.get('first_differ', '-')} |")
    if res.get("tensor_parallel", {}).get("ranks"):
        t = res["tensor_parallel"]
        lines += ["", f"Tensor parallel, {t['ranks']} ranks over {t['backend']} (CUDA graphs: {t['graphs']}): "
                      f"greedy = one rank's {t['equal']} (first differ at {t['first_differ'] or '-'}); "
                      f"{t['tok_s_two']:.0f} tok/s against {t['tok_s_one']:.0f} on one"]
    if res["errors"]:
        lines += ["", "Errors: " + "; ".join(f"{k}: {v.strip().splitlines()[-1]}"
                                             for k, v in res["errors"].items())]
    lines += ["", f"Total {res['seconds']:.0f} s: "
              + ", ".join(f"{k} {v:.0f} s" for k, v in res["section_s"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/out/gpu"))
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, same code paths")
    ap.add_argument("--model-dir", default=None, help="where the random model is built (cached)")
    ap.add_argument("--items", type=int, default=None, help="throughput workload size")
    ap.add_argument("--hf-batch", type=int, default=None)
    ap.add_argument("--peak-tbs", type=float, default=None, help="HBM peak in TB/s (default: by name)")
    ap.add_argument("--tie-tol", type=float, default=0.15, help="near-tie margin, in logit stds")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = dict(DRY if args.dry_run else FULL)
    if args.items:
        cfg["items"] = args.items
    if args.hf_batch:
        cfg["hf_batch"] = args.hf_batch
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if args.dry_run else "cuda")
    torch.manual_seed(0)
    res = dict(dry_run=args.dry_run, config={k: v for k, v in cfg.items() if k != "kernel_dtypes"},
               section_s={}, errors={})
    res["config"]["model"] = {k: str(v) for k, v in cfg["model"].items()}
    t0 = time.perf_counter()
    state = {}

    def write():
        """gpu.json and gpu.md as they stand: rewritten after every section, so a run cut
        short (a time limit, an OOM kill, a hang) keeps what it measured."""
        res["targets"] = targets(res)
        res["correct"] = correct(res)
        res["seconds"] = time.perf_counter() - t0
        os.makedirs(args.out, exist_ok=True)
        text = table(res)
        for name, body in (("gpu.json", json.dumps(res, indent=1, default=str)), ("gpu.md", text)):
            path = os.path.join(args.out, name)
            with open(path + ".tmp", "w") as f:
                f.write(body)
            os.replace(path + ".tmp", path)  # a kill mid-write leaves the last whole file
        return text

    def section(name, fn):
        print(f"== {name}", flush=True)
        t = time.perf_counter()
        try:
            res[name] = fn()
        except Exception:
            res["errors"][name] = traceback.format_exc()
            print(res["errors"][name], file=sys.stderr, flush=True)
        res["section_s"][name] = time.perf_counter() - t
        write()

    section("env", lambda: environment(dev, cfg, args.peak_tbs))
    section("kernels", lambda: kernel_checks(dev, cfg))
    model_dir = args.model_dir or os.path.join(
        ROOT, "bench/out", "gpu-model-dry" if args.dry_run else "gpu-model")
    section("model", lambda: dict(path=build_tiny_model(model_dir, **cfg["model"])))

    def startup():
        t = time.perf_counter()
        engine = Engine(model_dir, device=dev.type, dtype=cfg["dtype"],
                        kv_memory_fraction=cfg["kv_memory_fraction"])
        sync(dev)
        state["engine"] = engine
        runner = engine.runner
        # On a CPU nothing is captured: the same padded static-buffer path runs eagerly.
        state["graphs"] = runner.graphs or CudaGraphRunner(
            runner, batch_sizes(None, None, engine.scheduler.cfg.max_running), capture=False)
        hf_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg["dtype"]]
        state["hf"] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=hf_dtype).to(dev).eval()
        return dict(seconds=time.perf_counter() - t, kv_tokens=runner.kv_tokens, mem=runner.mem,
                    graph_sizes=state["graphs"].sizes, captured=bool(state["graphs"].graphs))

    if "model" in res:
        section("startup", startup)
    if "engine" in state:
        engine, hf, vocab = state["engine"], state["hf"], state["hf"].config.vocab_size
        section("greedy", lambda: greedy_check(engine, hf, state["graphs"], cfg, vocab, dev, args.tie_tol))
        engine.runner.graphs = state["graphs"]
        if "env" in res:
            section("decode_steps", lambda: decode_steps(engine, cfg, res["env"], dev))
        section("step_overhead", lambda: step_overhead(engine, cfg, vocab, dev))
        section("throughput", lambda: throughput(engine, hf, cfg, vocab, dev))
        section("eight_bit", lambda: eight_bit(engine, model_dir, cfg, vocab, dev))
        section("tensor_parallel", lambda: tensor_parallel(engine, model_dir, cfg, vocab, dev))
    section("vision", lambda: vision_check(dev, model_dir + "-vl"))
    print(write())
    return 0 if res["correct"] and not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
