"""LoRA adapters batched: the same requests run on the base model, and spread over 4 adapters
in the same steps, on the CPU, in one process, taking turns (each runs first in turn).

    python bench/lora.py                         # SmolLM2-135M (the demo model), 64 x 64 tokens
    python bench/lora.py --requests 8 --new-tokens 8 --rounds 1 --model PATH

Three runs a round, the same prompts and greedy lengths (EOS ignored) each time:
- base, plain: an engine without adapters (its MLP's gate and up fused in one kernel);
- base, LoRA engine: the engine holding the adapters, every request on the base model;
- mixed: the same engine, request i on adapter i % 4: every step holds rows of all four.
The adapters are random (peft, `init_lora_weights=False`), rank 16, on every projection. The
ratio that counts is mixed over base, plain: what serving adapters costs against not serving
any. Prints one JSON line per round and a summary with the median ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from worker.engine import Engine, SamplingParams  # noqa: E402
from worker.engine.models.demo import fetch_demo_model  # noqa: E402
from worker.engine.models.tiny import build_tiny_lora  # noqa: E402

WORDS = ("the a of river model light stone quiet number garden answer paper window system time "
         "music north small early open second table winter story").split()


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) for _ in range(n)]


def run(engine: Engine, texts: list[str], params: SamplingParams, loras: list[str | None]) -> tuple[float, int]:
    """(seconds, generated tokens) of every request queued at once, request i on loras[i % len]."""
    box = []
    t = time.perf_counter()
    for i, text in enumerate(texts):
        engine.add(("bench", i), [(i, text, None)], params, sink=box.append, lora=loras[i % len(loras)])
    while engine.has_work():
        engine.step()
    seconds = time.perf_counter() - t
    return seconds, sum(len(e.token_ids) for e in box if e.finished)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model folder or .gguf (default: the demo model)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = args.model or fetch_demo_model()
    names = [f"adapter{k}" for k in range(args.adapters)]
    with tempfile.TemporaryDirectory(prefix="fanout-lora-bench-") as folder:  # read at load
        specs = [f"{n}={build_tiny_lora(model, os.path.join(folder, n), k, r=args.rank, lora_alpha=2 * args.rank)}"
                 for k, n in enumerate(names)]
        plain, lora = Engine(model), Engine(model, lora=specs, max_lora_rank=args.rank)
    texts = prompts(args.requests, 0)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    runs = {"base, plain": (plain, [None]), "base, LoRA engine": (lora, [None]), "mixed": (lora, names)}
    for engine, loras in runs.values():  # warm-up: kernels, allocator
        run(engine, texts[:4], SamplingParams(max_new_tokens=4, ignore_eos=True), loras)
    print(json.dumps({"model": os.path.basename(model), "requests": args.requests, "new_tokens": args.new_tokens,
                      "adapters": args.adapters, "rank": args.rank, "threads": torch.get_num_threads()}))
    ratios = {"mixed / base, plain": [], "mixed / base, LoRA engine": []}
    order = list(runs)
    for r in range(args.rounds):
        rates = {}
        for name in order[r % len(order):] + order[:r % len(order)]:
            engine, loras = runs[name]
            seconds, tokens = run(engine, texts, params, loras)
            assert tokens == args.requests * args.new_tokens, (name, tokens)
            rates[name] = tokens / seconds
        ratios["mixed / base, plain"].append(rates["mixed"] / rates["base, plain"])
        ratios["mixed / base, LoRA engine"].append(rates["mixed"] / rates["base, LoRA engine"])
        print(json.dumps({"round": r, "tokens_per_s": {k: round(v, 1) for k, v in rates.items()},
                          "ratio": {k: round(v[-1], 3) for k, v in ratios.items()}}))
    print(json.dumps({"median": {k: round(statistics.median(v), 3) for k, v in ratios.items()},
                      "ratios": {k: [round(x, 3) for x in v] for k, v in ratios.items()}}))


if __name__ == "__main__":
    main()
