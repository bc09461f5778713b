"""The engine split over ranks against itself on one: the same greedy tokens, logits within
rounding, and what the split costs per step.

    python bench/tensor_parallel.py                    # the demo model (SmolLM2-135M), 1 and 3 ranks
    python bench/tensor_parallel.py --model DIR --sizes 1,2

bench/peers.py's mixed16 chats (16 real chats), 48 greedy tokens each, EOS masked until then;
then teacher-forced logits of the first 4 with their outputs; then decode speed: the 16
chats at once, 48 tokens, tok/s. The demo model has 9 query heads and 3 KV heads, so its
splits are 3 and 9 ranks (its GGUF codes are not split: every size loads it dense, fp32).
On a CPU every rank gets cores / ranks threads and the collectives are gloo's over
loopback: this measures correctness and the split's overhead, not a speed-up (a CPU split
pays off across sockets, a GPU one across devices). Results: stdout and
bench/out/tensor_parallel.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.out_file import save  # noqa: E402
from bench.peers import prompts  # noqa: E402
from worker.engine import Engine, SamplingParams  # noqa: E402
from worker.engine.models.demo import fetch_demo_model  # noqa: E402


def measure(path: str, size: int, chats: list[list[int]], tokens: int, repeats: int) -> dict:
    engine = Engine(path, tensor_parallel_size=size, quantization="none")
    try:
        sp = SamplingParams(max_new_tokens=tokens, min_new_tokens=tokens, temperature=0, ignore_eos=True)
        out = [it.samples[0].token_ids for it in engine.generate(input_ids=chats, sampling_params=sp)]
        logits = engine.prompt_logits([c + o for c, o in zip(chats[:4], out)])
        seconds = []
        for _ in range(repeats):
            engine.flush_cache()
            t = time.perf_counter()
            engine.generate(input_ids=chats, sampling_params=sp)
            seconds.append(time.perf_counter() - t)
        return {"outputs": out, "logits": logits, "seconds": seconds,
                "tok_s": len(chats) * tokens / statistics.median(seconds)}
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model folder or GGUF file (default: the demo model)")
    ap.add_argument("--sizes", default="1,3", help="tensor_parallel_size values, the first the reference")
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = args.model or fetch_demo_model()
    sizes = [int(s) for s in args.sizes.split(",")]
    from worker.engine.models.loader import load_tokenizer
    chats = prompts(load_tokenizer(path), f"mixed{args.chats}")
    runs = {size: measure(path, size, chats, args.tokens, args.repeats) for size in sizes}
    ref = runs[sizes[0]]
    rows = []
    for size, run in runs.items():
        diff = max(float((a - b).abs().max()) for (_, a), (_, b) in zip(ref["logits"], run["logits"]))
        rows.append({"ranks": size, "greedy_equal": sum(a == b for a, b in zip(ref["outputs"], run["outputs"])),
                     "of": len(chats), "max_logit_diff": diff, "tok_s": round(run["tok_s"], 1),
                     "seconds": [round(s, 3) for s in run["seconds"]],
                     "vs_first": round(run["tok_s"] / ref["tok_s"], 3)})
    print(f"{'ranks':>5} {'greedy equal':>13} {'max |logit diff|':>17} {'tok/s':>8} {'vs first':>9}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['greedy_equal']:>8} / {r['of']:<3} {r['max_logit_diff']:>17.2e} "
              f"{r['tok_s']:>8.1f} {r['vs_first']:>9.3f}")
    print("saved", save("tensor_parallel", {"model": path, "chats": len(chats), "tokens": args.tokens,
                                            "cores": len(os.sched_getaffinity(0)), "rows": rows}))


if __name__ == "__main__":
    main()
