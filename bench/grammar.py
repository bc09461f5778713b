"""Constrained decoding's cost: a batch whose every item has a JSON schema against the same
batch unconstrained, with the same output lengths.

    python bench/grammar.py                          # 128 items on the CPU; prints, writes JSON
    python bench/grammar.py --items 512 --device cuda

Model: SmolLM2-135M-Instruct, the demo model. Items: chats asking for a JSON record, cycling
through four schemas (nested objects, arrays, enums, bounded numbers), sampled at temperature
1 with a job seed. The constrained run goes first once (compiles the schemas, fixes every
sample's length); then each pair runs the constrained batch again (same seed: the same
tokens) and the unconstrained one, each item with max_new_tokens = its constrained length and
ignore_eos, so both runs make the same tokens in the same steps. The prefix cache is emptied
before every run. Throughput counts output tokens; the ratio is the median pair's, by wall
time and by this process's CPU time (on a shared machine other processes' load moves the
wall time of identical runs several-fold; the CPU time much less). "mask" is the share of the
constrained run's wall time spent filling and applying bitmasks.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from worker.engine import Engine, SamplingParams  # noqa: E402
from worker.engine.grammar import Masks  # noqa: E402
from worker.engine.models.demo import fetch_demo_model  # noqa: E402

SCHEMAS = [
    ("a person", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z.]{1,16}@[a-z]{1,12}\\.(com|org|net)$"}}, "required": ["name", "age"]}),
    ("an order", {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"]}},
        "status": {"enum": ["new", "paid", "shipped"]}}, "required": ["id", "items", "status"]}),
    ("a weather report", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "celsius": {"type": "number", "minimum": -40, "maximum": 50},
        "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}}, "required": ["city", "celsius", "sky"]}),
    ("a book", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 32},
        "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
        "required": ["title", "year", "tags"]}),
]


def chat(tok, what: str, i: int) -> str:
    return tok.apply_chat_template(
        [{"role": "user", "content": f"Invent {what} (number {i}) and give it as JSON."}],
        add_generation_prompt=True, tokenize=False)


def timed_masks():
    """Wrap Masks.apply to add up its time."""
    spent = [0.0]
    apply = Masks.apply

    def wrapper(self, *a):
        t = time.perf_counter()
        apply(self, *a)
        spent[0] += time.perf_counter() - t

    Masks.apply = wrapper
    return spent


def run(engine, prompts, params, seed):
    """(items, wall seconds, CPU seconds)"""
    engine.flush_cache()
    t, c = time.perf_counter(), time.process_time()
    items = engine.generate(prompts=prompts, sampling_params=params, seed=seed)
    return items, time.perf_counter() - t, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "grammar.json"))
    args = ap.parse_args()

    engine = Engine(fetch_demo_model(), device=args.device)
    tok = engine.tokenizer
    prompts = [chat(tok, SCHEMAS[i % len(SCHEMAS)][0], i) for i in range(args.items)]
    constrained = [SamplingParams(json_schema=SCHEMAS[i % len(SCHEMAS)][1], temperature=1.0,
                                  max_new_tokens=args.max_new_tokens) for i in range(args.items)]
    mask_time = timed_masks()
    t = time.perf_counter()
    first, _, _ = run(engine, prompts, constrained, args.seed)
    first_s = time.perf_counter() - t
    lengths = [len(it.samples[0].token_ids) for it in first]
    parsed = sum(s.finish_reason == "stop" and _parses(s.text) for it in first for s in it.samples)
    free = [SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True) for n in lengths]
    tokens = sum(lengths)

    pairs = []
    for _ in range(args.pairs):
        mask_time[0] = 0.0
        again, dt_c, cpu_c = run(engine, prompts, constrained, args.seed)
        assert [it.samples[0].token_ids for it in again] == [it.samples[0].token_ids for it in first]
        _, dt_f, cpu_f = run(engine, prompts, free, args.seed)
        pairs.append({"constrained_s": dt_c, "free_s": dt_f, "ratio": dt_f / dt_c,
                      "constrained_cpu_s": cpu_c, "free_cpu_s": cpu_f, "cpu_ratio": cpu_f / cpu_c,
                      "mask_share": mask_time[0] / dt_c})
    best = sorted(pairs, key=lambda p: p["ratio"])[len(pairs) // 2]
    cpu_ratio = statistics.median(p["cpu_ratio"] for p in pairs)
    result = {"device": args.device, "items": args.items, "output_tokens": tokens,
              "schemas": len(SCHEMAS), "grammars_compiled": engine.front.grammars.compiles,
              "first_run_s": first_s, "parsed": parsed,
              "constrained_tok_s": tokens / best["constrained_s"], "free_tok_s": tokens / best["free_s"],
              "ratio": best["ratio"], "cpu_ratio": cpu_ratio, "mask_share": best["mask_share"],
              "pairs": pairs}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{args.items} items ({len(SCHEMAS)} schemas, compiled {result['grammars_compiled']}x), "
          f"{tokens} output tokens on {args.device}; {parsed}/{args.items} parse "
          f"(the rest: cut at --max-new-tokens)")
    print(f"constrained {result['constrained_tok_s']:.0f} tok/s, unconstrained {result['free_tok_s']:.0f} "
          f"tok/s: {result['ratio']:.1%} (median of {args.pairs} pairs; by CPU time {cpu_ratio:.1%}); "
          f"masks {result['mask_share']:.1%} of the constrained wall time -> {args.out}")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
