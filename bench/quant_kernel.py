"""The CPU's matmul from a GGUF's codes (kernels/cpu_quant.c), its two ways, against the fp32
kernel (kernels/cpu_linear.c) on SmolLM2-135M's shapes.

    python bench/quant_kernel.py                  # Q4_1 and Q8_0, rows 1, 8, 64, 512
    python bench/quant_kernel.py --types Q4_1 --rows 1,8

For each weight type and shape (gate/up's 1536 x 576 and down's 576 x 1536), x [rows, k]
times the weight: exact (quantization auto: each code made its fp32 weight), dot (q8: x
rounded to 8 bits, integer sums) and fp32 (the dequantized weight in cpu_linear's panels).
Two settings, each the best of 5 passes of the mean call time:
- in cache: one weight, called again and again (its 0.7-1.1 MB stay in L2/L3): the kernels'
  arithmetic;
- from memory: 150 copies of the weight called in turn (~100 MB of codes, past every cache),
  as a decode step reads its model; the rate is the weight's bytes over the time.
Random codes and scales; the timings include the Python call.

Results: stdout and bench/out/quant_kernel.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.out_file import save  # noqa: E402
from worker.engine.kernels import cpu_linear, cpu_quant  # noqa: E402

SHAPES = {"gate/up": (1536, 576), "down": (576, 1536)}
# Weights per block, bytes per block, and where its f16 scales lie.
BLOCKS = {"Q4_0": (32, 18, [0]), "Q4_1": (32, 20, [0, 2]), "Q8_0": (32, 34, [0]), "Q4_K": (256, 144, [0, 2])}
COPIES = 150


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random blocks of that type, [n, bytes per row], each scale a small finite number
    (tests/test_quant.py reads them too)."""
    size, nbytes, scales = BLOCKS[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // size, nbytes), dtype=np.uint8)
    for at in scales:
        blocks[:, at:at + 2] = rng.uniform(0.001, 0.05, len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def best_call(fn, weights: list, x: torch.Tensor, calls: int) -> float:
    """Seconds a call, best of 5 passes (each `calls` calls over `weights` in turn)."""
    for w in weights:
        fn(x, w)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for i in range(calls):
            fn(x, weights[i % len(weights)])
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="Q4_1,Q8_0", help=f"of {', '.join(BLOCKS)}")
    ap.add_argument("--rows", default="1,8,64,512")
    ap.add_argument("--copies", type=int, default=COPIES, help="weights called in turn, from memory")
    args = ap.parse_args(argv)
    types = args.types.split(",")
    if bad := [t for t in types if t not in BLOCKS or any(k % BLOCKS[t][0] for _, k in SHAPES.values())]:
        ap.error(f"--types: {', '.join(bad)} not one of {', '.join(BLOCKS)} whose blocks divide SmolLM2's "
                 f"576 and 1536 input columns")
    if not (cpu_quant.load() and cpu_linear.load()):
        raise SystemExit("the C kernels could not be built (no C compiler)")
    rows = []
    for type_name in types:
        for shape, (n, k) in SHAPES.items():
            w = cpu_quant.from_blocks(type_name, random_blocks(type_name, n, k), n, k)
            ways = {"exact": (cpu_quant.linear, cpu_quant.pack(w)), "dot": (cpu_quant.linear, cpu_quant.pack(w, dot=True)),
                    "fp32": (cpu_linear.linear, cpu_linear.pack(w.dequantize()))}
            for m in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(m, k)
                calls = max(4, 200 // m)
                row = {"type": type_name, "shape": shape, "rows": m}
                for way, (fn, packed) in ways.items():
                    row[f"{way}_cache_us"] = round(best_call(fn, [packed], x, calls) * 1e6, 1)
                for way in ("exact", "dot"):  # from memory: the codes' copies in turn
                    copies = [cpu_quant.pack(w, dot=way == "dot") for _ in range(args.copies)] if m <= 8 else []
                    if copies:
                        t = best_call(cpu_quant.linear, copies, x, len(copies))
                        row[f"{way}_memory_us"] = round(t * 1e6, 1)
                        row[f"{way}_memory_gb_s"] = round(copies[0].nbytes / t / 1e9, 1)
                    del copies
                row["dot_vs_exact_cache"] = round(row["exact_cache_us"] / row["dot_cache_us"], 2)
                rows.append(row)
                print(row, flush=True)
    save("quant_kernel", {"threads": torch.get_num_threads(), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
