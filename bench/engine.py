"""Engine vs transformers `generate` on the same model, side by side in one run.

    python bench/engine.py              # both workloads, prints a table and writes JSON

(a) mixed: prompt lengths 32-512, output lengths 16-256 (greedy, every token kept).
(b) parallel: n=8 samples of prompts that share a long prefix.
transformers runs static batches as a user would write them: the list in order, chunks of
--hf-batch, left padding, max_new_tokens = the longest output asked for in the chunk.
Throughput counts only the tokens asked for. "peak" is the share of this machine's measured
fp32 matmul rate that each reaches: 2 x params x the tokens it actually ran through the model
(ours: prefill after cache hits + decode; transformers: padded batches), over its wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import AutoModelForCausalLM  # noqa: E402

from worker.engine import Engine, SamplingParams  # noqa: E402
from worker.engine.models.tiny import build_tiny_model  # noqa: E402


def bench_model(out_dir: str = "bench/out/model") -> str:
    """The benchmarks' model: random-weight Llama, 4 layers, hidden 256, GQA 8/2, built offline."""
    return build_tiny_model(out_dir, arch="llama", hidden_size=256, num_layers=4, num_heads=8,
                            num_kv_heads=2, intermediate_size=768, vocab_size=2048, max_context=1024)


def matmul_peak(n=1024, reps=20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t)


def workload_a(vocab, n, rng):
    return [([rng.randrange(3, vocab) for _ in range(rng.randrange(32, 513))], rng.randrange(16, 257))
            for _ in range(n)]


def workload_b(vocab, n, rng, prefix=768, suffix=32, out=64):
    shared = [rng.randrange(3, vocab) for _ in range(prefix)]
    return [(shared + [rng.randrange(3, vocab) for _ in range(suffix)], out) for _ in range(n)]


def run_ours(engine, work, n):
    sps = [SamplingParams(max_new_tokens=o, ignore_eos=True, n=n, temperature=0 if n == 1 else 1.0)
           for _, o in work]
    sched = engine.scheduler
    before = sched.prefill_tokens_total + sched.decode_tokens_total
    t = time.perf_counter()
    out = engine.generate(input_ids=[ids for ids, _ in work], sampling_params=sps, seed=0)
    dt = time.perf_counter() - t
    got = sum(len(s.token_ids) for it in out for s in it.samples)
    assert got == n * sum(o for _, o in work)
    return dt, sched.prefill_tokens_total + sched.decode_tokens_total - before


def run_hf(model, work, n, batch):
    t = time.perf_counter()
    computed = 0
    for i in range(0, len(work), batch):
        chunk = work[i:i + batch]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.tensor([[0] * (width - len(x)) + x for x, _ in chunk])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x, _ in chunk])
        new = max(o for _, o in chunk)
        computed += n * len(chunk) * (width + new - 1)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=n > 1, num_return_sequences=n, pad_token_id=0,
                           top_k=0, top_p=1.0, temperature=1.0)  # the same sampling as ours
    return time.perf_counter() - t, computed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default="bench/out/model")
    ap.add_argument("--items-a", type=int, default=20)
    ap.add_argument("--items-b", type=int, default=4)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--json", default="bench/out/engine.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    path = bench_model(args.model_dir)
    engine = Engine(path, page_size=16)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = sum(p.numel() for n_, p in hf.named_parameters() if "embed" not in n_)
    vocab = hf.config.vocab_size
    peak = matmul_peak()
    rng = random.Random(0)
    rows = {}
    for name, work, n in (("a_mixed", workload_a(vocab, args.items_a, rng), 1),
                          ("b_parallel_n8", workload_b(vocab, args.items_b, rng), 8)):
        run_ours(engine, work[:2], n)  # warm up both paths
        run_hf(hf, work[:1], n, 1)
        times, ratios = [], []
        for _ in range(args.reps):  # interleaved pairs, so machine noise hits both alike
            engine.flush_cache()  # nothing cached from an earlier run
            t_o, ours_tokens = run_ours(engine, work, n)
            t_h, hf_tokens = run_hf(hf, work, n, args.hf_batch)
            times.append((t_o, t_h))
            ratios.append(t_h / t_o)
        t_ours, t_hf = (statistics.median(t[k] for t in times) for k in (0, 1))
        out_tokens = n * sum(o for _, o in work)
        rows[name] = dict(out_tokens=out_tokens, ours_s=t_ours, hf_s=t_hf,
                          ours_tok_s=out_tokens / t_ours, hf_tok_s=out_tokens / t_hf,
                          ratio=statistics.median(ratios), ratios=ratios,
                          ours_model_tokens=ours_tokens, hf_model_tokens=hf_tokens,
                          ours_peak=2 * params * ours_tokens / t_ours / peak,
                          hf_peak=2 * params * hf_tokens / t_hf / peak)
    print(f"matmul peak (fp32, {torch.get_num_threads()} threads): {peak / 1e9:.1f} GFLOP/s; "
          f"model: {params / 1e6:.1f}M non-embedding params")
    print(f"{'workload':<16}{'ours tok/s':>12}{'hf tok/s':>10}{'ratio':>8}{'ours peak':>11}{'hf peak':>9}"
          f"   per-pair ratios")
    for name, r in rows.items():
        print(f"{name:<16}{r['ours_tok_s']:>12.1f}{r['hf_tok_s']:>10.1f}{r['ratio']:>7.2f}x"
              f"{r['ours_peak']:>10.1%}{r['hf_peak']:>9.1%}   "
              + " ".join(f"{x:.2f}" for x in r["ratios"]))
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(peak_flops=peak, params=params, workloads=rows), f, indent=1)


if __name__ == "__main__":
    main()
