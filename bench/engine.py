"""Engine vs transformers `generate` on the same model, side by side in one run.

    python bench/engine.py                              # every workload; prints a table, writes JSON
    python bench/engine.py --workloads real_a,real_b    # some of them (names below)

Models: `toy`, a random-weight Llama built offline (4 layers, hidden 256, GQA 8/2, 3.5M
non-embedding parameters), where per-step Python dominates; `real`, SmolLM2-135M-Instruct, the
demo model (30 layers, hidden 576, GQA 9/3, vocab 49,152; its Q4_1 GGUF dequantized to fp32 by
each side's own loader). Workloads:

  toy_a   20 random prompts of 32-512 tokens, outputs of 16-256 tokens, greedy
  toy_b   4 random prompts sharing a 768-token prefix (+32 each), n = 8 samples of 64 tokens
  real_a  32 chats (chat template) of mixed lengths, ~40-450 tokens, outputs of 16-160, greedy
  real_b  4 chats sharing a ~600-token system prompt, n = 8 samples of 64 tokens

Every output runs to its asked length (ignore_eos; transformers: min_new_tokens). Sampled
workloads (n = 8) draw at temperature 1 without top-k/top-p on both sides. transformers runs
static batches as a user would write them: the list in order, chunks of `hf_batch` prompts
(8 on the toy, 16 on the real model), left padding, max_new_tokens = the longest output asked
for in the chunk, n samples via num_return_sequences. Throughput counts only the tokens asked
for. Each workload runs in interleaved pairs (ours, then transformers) so machine noise hits
both alike; the ratio is the median pair. "peak" is the share of this machine's fp32 matmul
rate (1024^3 matmuls, measured before each pair; the median) that each side's matmul FLOPs
reach over its wall time: 2 x non-embedding params x the tokens it ran through the model (ours:
prefill after cache hits + decode; transformers: padded batches, every row to the chunk's
longest output) + 2 x vocab x hidden per row of logits it computed.
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
from worker.engine.models.demo import fetch_demo_model  # noqa: E402
from worker.engine.models.tiny import build_tiny_model  # noqa: E402

WORKLOADS = ("toy_a", "toy_b", "real_a", "real_b")

# Text for the chat workloads: what the words are does not change the cost, only the lengths.
SENTENCES = [
    "The committee met on Tuesday to review the budget for the coming year.",
    "Rainfall in the northern valleys was twice the seasonal average.",
    "Most of the new housing was built along the old railway line.",
    "The museum reopened after a long renovation of its east wing.",
    "Engineers replaced the bridge's bearings without closing it to traffic.",
    "Local farmers switched to drought-resistant varieties of wheat.",
    "A survey found that commuters value reliability over speed.",
    "The library extended its opening hours during the exam period.",
    "Two new bus routes connect the hospital with the suburbs.",
    "Volunteers planted more than three thousand trees along the river.",
    "The council postponed its decision on the parking fees.",
    "Sales of electric bicycles rose sharply in the spring.",
    "The old factory will become a school and a sports hall.",
    "Water usage fell after the city repaired its leaking mains.",
    "Several schools now teach programming from the age of eight.",
    "The festival drew visitors from across the region despite the rain.",
]
QUESTIONS = [
    "Summarize the text above in two sentences.", "What is the main topic of this passage?",
    "List the facts above as bullet points.", "Which of these changes matters most, and why?",
    "Write a short headline for this.", "Rewrite this in simpler words.",
    "What questions would a journalist ask next?", "Give me three tips for sleeping better.",
    "Explain photosynthesis in one paragraph.", "Write a haiku about the sea.",
]
RULES = ("You are the support assistant of a regional transport company. Follow these rules "
         "in every answer. ")


def toy_model(out_dir: str = "bench/out/model") -> str:
    """Random-weight Llama, 4 layers, hidden 256, GQA 8/2, built offline."""
    return build_tiny_model(out_dir, arch="llama", hidden_size=256, num_layers=4, num_heads=8,
                            num_kv_heads=2, intermediate_size=768, vocab_size=2048, max_context=1024)


def matmul_peak(n=1024, reps=20) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t)


def toy_a(vocab, rng, n=20):
    return [([rng.randrange(3, vocab) for _ in range(rng.randrange(32, 513))], rng.randrange(16, 257))
            for _ in range(n)]


def toy_b(vocab, rng, n=4, prefix=768, suffix=32, out=64):
    shared = [rng.randrange(3, vocab) for _ in range(prefix)]
    return [(shared + [rng.randrange(3, vocab) for _ in range(suffix)], out) for _ in range(n)]


def chat(tok, messages) -> list[int]:
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


def real_a(tok, rng, n=32):
    """Chats from a bare question to a question about a long passage (0-28 sentences)."""
    work = []
    for _ in range(n):
        text = " ".join(rng.choice(SENTENCES) for _ in range(rng.randrange(0, 29)))
        user = f"{text}\n\n{rng.choice(QUESTIONS)}" if text else rng.choice(QUESTIONS)
        work.append((chat(tok, [{"role": "user", "content": user}]), rng.randrange(16, 161)))
    return work


def real_b(tok, rng, n=4, out=64):
    system = RULES + " ".join(SENTENCES[i % len(SENTENCES)] for i in range(40))
    return [(chat(tok, [{"role": "system", "content": system},
                        {"role": "user", "content": q}]), out) for q in rng.sample(QUESTIONS, n)]


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
    return dt, sched.prefill_tokens_total + sched.decode_tokens_total - before, got


def run_hf(model, work, n, batch, pad, temperature=1.0, outputs=None):
    """Static batches of `batch` prompts; sampled at `temperature` when n > 1. `outputs`, if
    given, gets each sequence's tokens asked for, in order (n per prompt)."""
    t = time.perf_counter()
    computed = logit_rows = 0
    for i in range(0, len(work), batch):
        chunk = work[i:i + batch]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x, _ in chunk])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x, _ in chunk])
        new = max(o for _, o in chunk)
        computed += n * len(chunk) * (width + new - 1)
        logit_rows += n * len(chunk) * new  # generate keeps one prefill row per sequence
        # Sampling as ours: no top-k/top-p (generation_config may set them).
        sample = dict(top_k=0, top_p=1.0, temperature=temperature) if n > 1 else {}
        with torch.inference_mode():
            seqs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                  min_new_tokens=new, num_return_sequences=n, pad_token_id=pad,
                                  do_sample=n > 1, **sample)
        if outputs is not None:
            outputs += [seqs[k, width:width + chunk[k // n][1]].tolist() for k in range(len(seqs))]
    return time.perf_counter() - t, computed, logit_rows


def load(kind: str):
    """(engine, transformers model, tokenizer) of the toy or the real model."""
    if kind == "toy":
        path = toy_model()
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        path = fetch_demo_model()
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), dtype=torch.float32,
                                                  gguf_file=os.path.basename(path))
    engine = Engine(path, page_size=16)
    return engine, hf.eval(), engine.tokenizer


def bench(engine, hf, work, n, hf_batch, reps):
    cfg = hf.config
    params = sum(p.numel() for name, p in hf.named_parameters() if "embed" not in name)
    head = cfg.vocab_size * cfg.hidden_size
    pad = engine.tokenizer.pad_token_id or 0
    run_ours(engine, work[:2], n)  # warm up both paths
    run_hf(hf, work[:1], n, 1, pad)
    pairs, peaks = [], []
    for _ in range(reps):  # interleaved pairs, so machine noise hits both alike
        peaks.append(matmul_peak())
        engine.flush_cache()  # nothing cached from an earlier run
        pairs.append((run_ours(engine, work, n), run_hf(hf, work, n, hf_batch, pad)))
    ratios = [h[0] / o[0] for o, h in pairs]
    mid = sorted(range(reps), key=ratios.__getitem__)[reps // 2]  # the median pair
    (t_o, tok_o, rows_o), (t_h, tok_h, rows_h) = pairs[mid]
    peak = statistics.median(peaks)
    out_tokens = n * sum(o for _, o in work)
    return dict(items=len(work), n=n, out_tokens=out_tokens,
                prompt_tokens=[len(ids) for ids, _ in work], ours_s=t_o, hf_s=t_h,
                ours_tok_s=out_tokens / t_o, hf_tok_s=out_tokens / t_h,
                ratio=ratios[mid], ratios=ratios, pairs_s=[(o[0], h[0]) for o, h in pairs],
                ours_model_tokens=tok_o, hf_model_tokens=tok_h, peak_flops=peak, peaks=peaks,
                ours_peak=(2 * params * tok_o + 2 * head * rows_o) / t_o / peak,
                hf_peak=(2 * params * tok_h + 2 * head * rows_h) / t_h / peak)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved pairs per workload")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--json", default="bench/out/engine.json")
    args = ap.parse_args()
    names = args.workloads.split(",")
    if bad := [w for w in names if w not in WORKLOADS]:
        ap.error(f"--workloads: unknown {', '.join(bad)} (use {', '.join(WORKLOADS)})")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = {}
    for kind in ("toy", "real"):
        mine = [w for w in WORKLOADS if w in names and w.startswith(kind)]
        if not mine:
            continue
        engine, hf, tok = load(kind)
        for name in mine:
            rng = random.Random(0)
            if kind == "toy":
                vocab = hf.config.vocab_size
                work, n = (toy_a(vocab, rng), 1) if name == "toy_a" else (toy_b(vocab, rng), 8)
            else:
                work, n = (real_a(tok, rng), 1) if name == "real_a" else (real_b(tok, rng), 8)
            rows[name] = bench(engine, hf, work, n, 8 if kind == "toy" else 16, args.reps)
        del engine, hf
    print(f"fp32, {torch.get_num_threads()} threads; matmul peak (median per workload): "
          + ", ".join(f"{r['peak_flops'] / 1e9:.0f}" for r in rows.values()) + " GFLOP/s")
    print(f"{'workload':<9}{'ours tok/s':>11}{'hf tok/s':>10}{'ratio':>8}{'ours peak':>11}{'hf peak':>9}"
          f"   per-pair ratios")
    for name, r in rows.items():
        print(f"{name:<9}{r['ours_tok_s']:>11.1f}{r['hf_tok_s']:>10.1f}{r['ratio']:>7.2f}x"
              f"{r['ours_peak']:>10.1%}{r['hf_peak']:>9.1%}   "
              + " ".join(f"{x:.2f}" for x in r["ratios"]))
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(threads=torch.get_num_threads(), workloads=rows), f, indent=1)


if __name__ == "__main__":
    main()
