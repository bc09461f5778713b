"""Where a recorded decode step's time goes on a CPU, kernel by kernel, with the weights each
reads and the rate it reached: the inside of bench/roofline.py's steps (bench/step.py times
the Python around them).

    python bench/replay_calls.py                       # the demo GGUF, q8 and auto, batches 1 and 8
    python bench/replay_calls.py --formats none --batches 1 --replays 300

For each format (EngineConfig.quantization) and batch size, that many requests decode until
the size's recording exists (cuda_graph.py: a CPU graph, the forward as its C kernel calls),
then the recording is replayed --replays times in --rounds rounds, each call timed in C
(cpu_graph.fanout_replay_timed: two clock reads around each call, ~50 ns). Calls are grouped
by C function and the weight they read (its module path, layers folded: `layers.*.mlp.gate_up`);
a call's weight bytes are those of the packed weights (cpu_linear.Panels, cpu_quant.QPanels)
whose memory it is passed. A row: calls a step, us a call, ms a step, MB of weights a step,
GB/s (the weights' bytes over the call's time; the KV and activations not counted) and
share of the step, from the fastest round. The machine's read and copy rates
(bench/roofline.py's) are taken before each round, to set the rates against.

Results: stdout and bench/out/replay_calls.json.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.out_file import save  # noqa: E402
from bench.roofline import rates, tensors  # noqa: E402
from worker.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from worker.engine.kernels.cpu_linear import Panels  # noqa: E402
from worker.engine.kernels.cpu_quant import QPanels  # noqa: E402
from worker.engine.models.demo import fetch_demo_model  # noqa: E402


def weights(model: torch.nn.Module) -> dict[int, tuple[str, int]]:
    """The packed weights' memory: first byte's address -> (module path, layers folded; bytes)."""
    out = {}
    for name, m in model.named_modules():
        for attr, v in vars(m).items():
            if isinstance(v, (Panels, QPanels)):
                label = re.sub(r"\.\d+\.", ".*.", f"{name}.{attr}".lstrip("."))
                parts = (v.data,) if isinstance(v, Panels) else (v.codes, v.scales)
                for t in parts:
                    out[t.data_ptr()] = (label, t.numel() * t.element_size())
    return out


def recording(engine: Engine, batch: int):
    """The recording of batch size `batch`, made by running that many requests."""
    items = [(i, None, list(range(100 + 7 * i, 116 + 7 * i))) for i in range(batch)]
    engine.add("calls", items, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    graphs = engine.runner.graphs
    if graphs is None or batch not in graphs.recordings:
        raise SystemExit(f"no CPU graph of batch {batch} (cuda_graph off, or not recordable here)")
    return graphs.recordings[batch][0]


def profile(engine: Engine, batch: int, replays: int, rounds: int, probe) -> dict:
    rec = recording(engine, batch)
    known = weights(engine.runner.model)
    kinds, nbytes = [], []
    for name, c in zip(rec.kernels, rec.calls):
        read = {known[a] for a in c.i if a in known}
        labels = sorted({label for label, _ in read})
        kinds.append(f"{name} {'+'.join(labels)}".strip())
        nbytes.append(sum(b for _, b in read))
    best = None
    for _ in range(rounds):
        machine = rates(*probe)
        seconds = (ctypes.c_double * len(rec.calls))()
        for _ in range(5):  # warm
            rec.replay()
        for _ in range(replays):
            rec.replay_timed(seconds)
        step = sum(seconds) / replays
        if best is None or step < best[0]:
            best = (step, list(seconds), machine)
    step, seconds, machine = best
    groups: dict[str, list] = defaultdict(lambda: [0, 0.0, 0])
    for kind, s, b in zip(kinds, seconds, nbytes):
        g = groups[kind]
        g[0], g[1], g[2] = g[0] + 1, g[1] + s / replays, g[2] + b
    rows = []
    for kind, (n, s, b) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        rows.append({"kind": kind, "calls": n, "us_call": round(s / n * 1e6, 1),
                     "ms_step": round(s * 1e3, 3), "weights_mb": round(b / 1e6, 2),
                     "gb_s": round(b / s / 1e9, 1) if b else None, "share": round(s / step, 3)})
    return {"batch": batch, "step_ms": round(step * 1e3, 3), "calls": len(kinds),
            "weights_mb": round(sum(nbytes) / 1e6, 1),
            "gb_s": round(sum(nbytes) / step / 1e9, 1), **machine, "rows": rows}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the demo model)")
    ap.add_argument("--formats", default="q8,auto", help="quantization values, one engine each")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--replays", type=int, default=200, help="timed replays a round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the fastest is reported")
    ap.add_argument("--gib", type=float, default=1.0, help="size of the bandwidth test's tensor")
    args = ap.parse_args(argv)
    path = args.model or fetch_demo_model()
    batches = [int(b) for b in args.batches.split(",")]
    probe = tensors(args.gib)
    out = []
    for f in args.formats.split(","):
        engine = Engine(path, config=EngineConfig(device="cpu", quantization=f, max_running=max(batches)))
        for b in batches:
            r = {"format": f, **profile(engine, b, args.replays, args.rounds, probe)}
            out.append(r)
            print(f"\n{f}, batch {b}: {r['step_ms']} ms a replay, {r['calls']} calls, "
                  f"{r['weights_mb']} MB of weights = {r['gb_s']} GB/s "
                  f"(the machine before: copy {r['copy_gb_s']}, read {r['read_gb_s']} GB/s)")
            print(f"{'calls':>5} {'us/call':>8} {'ms/step':>8} {'MB':>7} {'GB/s':>5} {'share':>6}  kernel, weights")
            for row in r["rows"]:
                gb = "" if row["gb_s"] is None else row["gb_s"]
                print(f"{row['calls']:>5} {row['us_call']:>8} {row['ms_step']:>8} {row['weights_mb']:>7} "
                      f"{gb:>5} {row['share']:>6.1%}  {row['kind']}")
        del engine
    save("replay_calls", {"runs": out})
    return out


if __name__ == "__main__":
    main()
