"""Where a decode step's time goes, on the real model: the forward against everything else
(scheduling, batch building, sampling, fan-in, events), at batch 8, 16 and 64.

    python bench/step.py                  # SmolLM2-135M-Instruct (the demo GGUF), its codes
    python bench/step.py --quantization none   # the same dequantized to fp32
    python bench/step.py --batches 8,64 --tokens 48

Each batch size runs that many distinct prompts (~100 tokens) to --tokens new tokens (greedy,
then sampled at T=0.8, then at T=0.8 with top_p 0.95), timing the engine's parts by wrapping them in this
process (the engine is not changed for it). Only steps that decode every running request one
token are counted (no prefill in them). Parts:

- forward: ModelRunner.forward (the model, attention metadata included);
- sample: the Sampler (penalties, masks, seeded draws, the argmax);
- batch: ScheduleBatch.to_forward_batch (the step's input tensors);
- schedule: Scheduler.schedule (admission, KV allocation);
- process: Scheduler.process (tokens applied, finishes);
- collect: Front.collect (detokenizing, stop strings, events);
- other: the rest of Engine.step (feed, the executor's own bookkeeping: logits rows, the
  sampled rows' gather).

Results: stdout and bench/out/step.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from worker.engine import Engine, SamplingParams  # noqa: E402
from worker.engine.batch import ScheduleBatch  # noqa: E402
from worker.engine.models.demo import fetch_demo_model  # noqa: E402
from bench.out_file import save  # noqa: E402

PARTS = ("forward", "sample", "batch", "schedule", "process", "collect", "other")


class Timer:
    """Seconds per part for the current step."""

    def __init__(self):
        self.now: defaultdict[str, float] = defaultdict(float)

    def wrap(self, obj, name: str, part: str):
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[part] += time.perf_counter() - t
        setattr(obj, name, timed)


def prompts(n: int) -> list[str]:
    words = "the river runs past the old mill where the miller keeps his cats and counts the sacks".split()
    return [" ".join(words[(i + k) % len(words)] for k in range(70)) + f" Question {i}: what comes next?"
            for i in range(n)]


def measure(engine: Engine, timer: Timer, batch: int, tokens: int, sp: SamplingParams) -> dict:
    tag = object()
    items = [(i, p, None) for i, p in enumerate(prompts(batch))]
    engine.add(tag, items, sp, seed=1)
    steps = []
    while engine.has_work():
        timer.now.clear()
        t = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t
        if timer.now.get("decode_step"):
            steps.append({**{k: v for k, v in timer.now.items() if k != "decode_step"}, "total": total})
    if not steps:
        raise RuntimeError("no decode step was seen")
    med = {p: statistics.median(s.get(p, 0.0) for s in steps) for p in PARTS[:-1]}
    med["total"] = statistics.median(s["total"] for s in steps)
    med["other"] = max(0.0, med["total"] - sum(med[p] for p in PARTS[:-1]))
    return {"batch": batch, "decode_steps": len(steps), "ms": {k: 1e3 * v for k, v in med.items()},
            "not_forward": 1 - med["forward"] / med["total"],
            "not_forward_nor_sample": 1 - (med["forward"] + med["sample"]) / med["total"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,16,64")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--quantization", default="auto", help="the engine's quantization (auto: the GGUF's codes)")
    args = ap.parse_args()
    engine = Engine(fetch_demo_model(), device="cpu", dtype="float32", quantization=args.quantization)
    timer = Timer()
    timer.wrap(engine.runner, "forward", "forward")
    timer.wrap(engine.executor, "sampler", "sample")
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "process", "process")
    timer.wrap(engine.front, "collect", "collect")
    build = ScheduleBatch.to_forward_batch

    def to_forward_batch(self, *a, **kw):
        t = time.perf_counter()
        try:
            return build(self, *a, **kw)
        finally:
            timer.now["batch"] += time.perf_counter() - t
            if all(n == 1 for n in self.extend_lens) and all(r.output_ids for r in self.reqs):
                timer.now["decode_step"] = 1.0
    ScheduleBatch.to_forward_batch = to_forward_batch
    engine.generate(prompts=prompts(4), sampling_params=SamplingParams(max_new_tokens=4))  # warm-up
    out = []
    for batch in (int(b) for b in args.batches.split(",")):
        for name, sp in (("greedy", SamplingParams(max_new_tokens=args.tokens, temperature=0, ignore_eos=True)),
                         ("T=0.8", SamplingParams(max_new_tokens=args.tokens, temperature=0.8, ignore_eos=True)),
                         ("top_p", SamplingParams(max_new_tokens=args.tokens, temperature=0.8, top_p=0.95,
                                                  ignore_eos=True))):
            row = {"sampling": name, **measure(engine, timer, batch, args.tokens, sp)}
            out.append(row)
            ms = row["ms"]
            print(f"batch {batch:3d} {name:7s}: step {ms['total']:6.1f} ms, forward {ms['forward']:6.1f}, "
                  f"sample {ms['sample']:5.1f}, " + ", ".join(f"{p} {ms[p]:4.2f}" for p in PARTS[2:])
                  + f"  | not forward {100 * row['not_forward']:.1f}%, neither forward nor sample "
                  f"{100 * row['not_forward_nor_sample']:.1f}%", flush=True)
    save("step", out)


if __name__ == "__main__":
    main()
