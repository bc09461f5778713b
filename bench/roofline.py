"""Small-batch decode against the memory's roofline: at batch 1-8 a decode step reads every
weight of the model, so its floor is the weights' bytes over the bandwidth the machine streams.

    python bench/roofline.py                      # the demo GGUF (SmolLM2-135M, Q4_1), batches 1,2,4,8
    python bench/roofline.py --batches 1,8 --tokens 64 --repeats 3 --formats auto,q8,none
    python bench/roofline.py --formats auto,none --eager   # recorded decode steps against eager ones

An engine a format on the same file, their runs interleaved (--formats, EngineConfig.quantization):
its weights kept quantized with exact fp32 products (auto, the default: kernels/cpu_quant.c),
kept quantized with the activations rounded to 8 bits for integer products (q8), and
dequantized to fp32 (none). For each batch size, that many
requests of 16 prompt tokens decode --tokens new tokens (greedy, ignore_eos); the steps
timed are those in which every request decodes (after the prefill): a run's median step,
the best of --repeats runs.

A step reads the weights in memory (ModelRunner.mem["weights"]) and the batch's KV cache
(the tokens it holds x bytes per token); bytes / step time is the rate it reached. The
machine's rate is taken just before each run: a copy of a --gib float32 tensor (STREAM's
copy: bytes read + written over the time) and a read pass over it (torch's sum on every
thread), each the best of 3 (and the best of 5 before and after the whole benchmark, 2 x
--gib of tensors held meanwhile). A run's share of the
roofline = its median step's bytes/s over the rate taken before it; a row gives its format
and batch's fastest run (ms a step, tok/s, GB/s) and the median share over the --repeats
runs, with their range. Why each run against its own rate: a shared VM's rate moves with its
neighbours, 33-80 GB/s from one minute to the next on one seen here, and so does its CPU
time, so a rate from another minute says little of the one a run met. The read is the
stricter roofline: a read alone streams faster than a copy on the machines seen.

The other side of the roofline is the products: at batch b a step does b multiply-adds per
weight, and from some batch on the cores take longer over them than the memory over the
bytes. `products_floor` times the step's matmuls with every weight in cache (the kernels'
own calls, replayed without Python; after each run, the fastest of them kept, as the
step's fastest run is); a row's `bound` says which floor is the higher at its
batch (the step's bytes at the runs' median copy rate, or the products), and
`of_floor` is that floor over the fastest step: how close the step came to what this
machine allows at that batch, where the share of the copy rate cannot say it.

Results: stdout and bench/out/roofline.json.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.out_file import save  # noqa: E402
from worker.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from worker.engine.kernels import cpu_graph  # noqa: E402
from worker.engine.kv_pool import KVPool  # noqa: E402
from worker.engine.models.demo import fetch_demo_model  # noqa: E402

GB = 1e9


def rates(a: torch.Tensor, b: torch.Tensor, repeats: int = 3) -> dict:
    """Read and copy rates of this machine, GB/s (each the best of repeats): a read pass over
    a, and a into b (bytes read + written)."""
    read = copy = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        read = max(read, a.numel() * 4 / (time.perf_counter() - t) / GB)
        t = time.perf_counter()
        b.copy_(a)
        copy = max(copy, 2 * a.numel() * 4 / (time.perf_counter() - t) / GB)
    return {"read_gb_s": round(read, 1), "copy_gb_s": round(copy, 1)}


def tensors(gib: float) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.ones(int(gib * 2**30) // 4)
    return a, torch.empty_like(a)


def bandwidth(gib: float = 1.0, repeats: int = 5) -> dict:
    """Read and copy rates of this machine, GB/s (best of repeats)."""
    return rates(*tensors(gib), repeats)


def products_floor(engine: Engine, batch: int, calls: int = 8, repeats: int = 3) -> float:
    """Seconds a decode step's matmuls take at this batch with every weight in cache: the
    compute side of the roofline, which no step beats whatever the memory. Each distinct
    packed weight of the model (its kernel's panels: codes, or fp32 for format none) times
    [batch, k], `calls` calls recorded and replayed with no Python between them
    (kernels/cpu_graph.py), the best of `repeats` replays, times the weights of its shape.
    The weight stays in L2/L3 from call to call (about 1 MB a layer's; lm_head's 30 MB
    codes the most). It counts the kernels' own work (x's rounding, scales, threads), not
    what the rest of the step adds."""
    by_shape: dict[tuple, list] = {}
    for m in engine.runner.model.modules():
        for v in vars(m).values():
            if hasattr(v, "matmul") and isinstance(getattr(v, "k", None), int):
                key = (type(v).__name__, v.n, v.k, getattr(v, "bits", 32), getattr(v, "dot", False))
                by_shape.setdefault(key, []).append(v)
    total = 0.0
    for packed in by_shape.values():
        x = torch.randn(batch, packed[0].k)
        rec = cpu_graph.record(lambda: [packed[0].matmul(x) for _ in range(calls)])
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            rec.replay()
            best = min(best, (time.perf_counter() - t) / calls)
        total += best * len(packed)
    return total


def decode(engine: Engine, batch: int, tokens: int) -> tuple[float, int]:
    """(the median seconds of the run's all-decode steps, KV tokens held at its middle)."""
    g = torch.Generator().manual_seed(batch)
    vocab = engine.runner.config.vocab_size
    items = [(i, None, torch.randint(100, vocab, (16,), generator=g).tolist()) for i in range(batch)]
    engine.add("roofline", items, SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True))
    times, steps = [], 0
    while engine.has_work():
        t = time.perf_counter()
        events = engine.step()
        dt = time.perf_counter() - t
        steps += 1
        if steps > 2 and len(events) == batch and not any(e.finished for e in events):
            times.append(dt)
    times.sort()
    return times[len(times) // 2], 16 + tokens // 2


def measure(path: str, formats: list[str], batches: list[int], tokens: int, repeats: int,
            gib: float) -> list[dict]:
    """Every format's engine loaded at once, their runs interleaved (for each repeat and batch,
    each format in turn), so a burst of load elsewhere on the machine falls on all of them;
    the machine's rates taken before each run, and kept with it."""
    def engine(f: str) -> Engine:  # "F/eager": format F with every step eager (no CPU graphs)
        q, _, eager = f.partition("/")
        return Engine(path, config=EngineConfig(device="cpu", quantization=q, max_running=max(batches),
                                                cuda_graph=not eager))

    engines = {f: engine(f) for f in formats}
    probe = tensors(gib)
    runs: dict[tuple[str, int], list[tuple[float, dict]]] = {}  # (step seconds, rates before it)
    held: dict[int, int] = {}
    floors: dict[tuple[str, int], list[float]] = {}  # each run's products floor, taken after it
    for engine in engines.values():
        decode(engine, 2, 8)  # warm-up
    for _ in range(repeats):
        for b in batches:
            for f, engine in engines.items():
                machine = rates(*probe)
                step, held[b] = decode(engine, b, tokens)
                runs.setdefault((f, b), []).append((step, machine))
                floors.setdefault((f, b), []).append(products_floor(engine, b))
    del probe
    rows = []
    for f, engine in engines.items():
        c = engine.runner.config
        per_token = KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32)
        weights = engine.runner.mem["weights"]
        for b in batches:
            step_bytes = weights + b * held[b] * per_token
            step = min(s for s, _ in runs[f, b])
            row = {"format": f, "batch": b, "weights_mb": round(weights / 1e6, 1),
                   "step_mb": round(step_bytes / 1e6, 1), "step_ms": round(step * 1e3, 2),
                   "tok_s": round(b / step, 1), "gb_s": round(step_bytes / step / GB, 1)}
            for k in ("copy", "read"):  # each run against the rate taken just before it
                shares = sorted(step_bytes / s / GB / m[f"{k}_gb_s"] for s, m in runs[f, b])
                row[f"{k}_gb_s"] = round(statistics.median(m[f"{k}_gb_s"] for _, m in runs[f, b]), 1)
                row[f"of_{k}"] = round(statistics.median(shares), 3)
                row[f"of_{k}_range"] = [round(shares[0], 3), round(shares[-1], 3)]
            # The roofline's floor: the bytes at the copy rate, or the products, the longer.
            memory, products = step_bytes / GB / row["copy_gb_s"], min(floors[f, b])
            floor = max(memory, products)
            row.update(products_ms=round(products * 1e3, 2), floor_ms=round(floor * 1e3, 2),
                       bound="products" if products > memory else "memory", of_floor=round(floor / step, 3))
            rows.append(row)
            print(row, flush=True)
    del engines
    gc.collect()
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the demo model)")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gib", type=float, default=1.0, help="size of the bandwidth test's tensor")
    ap.add_argument("--formats", default="auto,q8,none", help="quantization values, one engine each")
    ap.add_argument("--eager", action="store_true", help="also each format with its decode steps "
                    "run eagerly (F/eager: cuda_graph off, no recorded CPU forwards)")
    args = ap.parse_args(argv)
    path = args.model or fetch_demo_model()
    batches = [int(b) for b in args.batches.split(",")]
    before = bandwidth(args.gib)
    print("machine before:", before, flush=True)
    formats = args.formats.split(",")
    formats += [f"{f}/eager" for f in formats] if args.eager else []
    rows = measure(path, formats, batches, args.tokens, args.repeats, args.gib)
    after = bandwidth(args.gib)
    print("machine after:", after, flush=True)
    print(f"\n{'format':>10} {'batch':>5} {'MB/step':>8} {'ms/step':>8} {'tok/s':>7} {'GB/s':>6} "
          f"{'copy GB/s':>9} {'of copy (range)':>16} {'read GB/s':>9} {'of read (range)':>16} "
          f"{'products ms':>11} {'bound':>8} {'of floor':>8}")

    def share(r, k):
        lo, hi = r[f"of_{k}_range"]
        return f"{r[f'of_{k}']:.0%} ({lo:.0%}-{hi:.0%})"

    for r in rows:
        print(f"{r['format']:>10} {r['batch']:>5} {r['step_mb']:>8} {r['step_ms']:>8} {r['tok_s']:>7} "
              f"{r['gb_s']:>6} {r['copy_gb_s']:>9} {share(r, 'copy'):>16} {r['read_gb_s']:>9} "
              f"{share(r, 'read'):>16} {r['products_ms']:>11} {r['bound']:>8} {r['of_floor']:>8.0%}")
    save("roofline", {"machine": {"before": before, "after": after},
                      "tokens": args.tokens, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
