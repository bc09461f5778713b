"""A big job with the radix prefix cache on vs off, side by side in one run: the cost of
keeping and evicting a cache that fills the pool.

    python bench/prefix_cache.py                       # 40,000 items, a 262,144-token pool
    python bench/prefix_cache.py --items 10000 --kv-tokens 0   # the default pool

Distinct prompts (so the cache never hits and only its bookkeeping shows: inserts, locks
and, once the pool is full, eviction at every admission), 8 new tokens each, greedy, on the
tests' tiny random-weight Llama in this process. Pairs alternate on, off, on, off; the
ratio is on / off per pair (target <= 1.2; before eviction kept its heap: 16x at 40,000
items). Results: stdout and bench/out/prefix_cache.json.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from worker.engine import Engine, SamplingParams, freeze_gc  # noqa: E402
from worker.engine.models.tiny import build_tiny_model  # noqa: E402
from bench.out_file import save  # noqa: E402


def run(model: str, prompts: list[list[int]], cache: bool, kv_tokens: int | None) -> dict:
    eng = Engine(model, device="cpu", enable_prefix_cache=cache, kv_tokens=kv_tokens)
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    out = eng.generate(input_ids=prompts, sampling_params=sp)
    seconds = time.perf_counter() - t
    eng.check()
    return {"seconds": seconds, "evict_pops": eng.kv_manager.cache.evict_pops,
            "tokens": [it.samples[0].token_ids for it in out]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=40_000)
    ap.add_argument("--kv-tokens", type=int, default=262_144, help="0: the engine's default pool")
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    model = build_tiny_model(os.path.join(tempfile.mkdtemp(), "llama"), arch="llama")
    rng = random.Random(0)
    # 24-40 tokens each, distinct from the first token on: no prefix is shared.
    prompts = [[3 + i % 200, 3 + i // 200 % 200] + [rng.randrange(3, 250) for _ in range(rng.randrange(22, 38))]
               for i in range(args.items)]
    kv = args.kv_tokens or None
    run(model, prompts[:500], True, kv)  # warm-up: the first engine in a process pays one-time costs
    freeze_gc()  # the libraries' objects, as a worker freezes them once its engine is loaded
    pairs = []
    for p in range(args.pairs):
        on, off = run(model, prompts, True, kv), run(model, prompts, False, kv)
        assert on["tokens"] == off["tokens"], "the cache changed outputs"
        pairs.append({"on_s": on["seconds"], "off_s": off["seconds"], "ratio": on["seconds"] / off["seconds"],
                      "evict_pops": on["evict_pops"]})
        print(f"pair {p}: cache on {on['seconds']:.1f}s, off {off['seconds']:.1f}s, ratio "
              f"{pairs[-1]['ratio']:.2f}; heap entries looked at by eviction {on['evict_pops']}", flush=True)
    out = {"items": args.items, "kv_tokens": args.kv_tokens, "pairs": pairs,
           "median_ratio": statistics.median(p["ratio"] for p in pairs)}
    save("prefix_cache", out)
    print(f"cache on / off: {out['median_ratio']:.2f} (target <= 1.2)")


if __name__ == "__main__":
    main()
