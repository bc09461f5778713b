"""bench/fleet_sim.py at a small size: real worker loops on the simulated engine store samples
through the whole Redis protocol, and the per-sample figures come out."""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_fleet_simulation_runs():
    spec = importlib.util.spec_from_file_location("fleet_sim", os.path.join(ROOT, "bench", "fleet_sim.py"))
    sim = sys.modules["fleet_sim"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(sim)
    out = sim.run(workers=1, batch=16, steps=30, seconds=4, tokens=8, warmup=2)
    assert out["samples"] > 0 and out["shards_per_s"] > 0, out
    assert out["redis_commands_per_sample"] > 0 and out["redis_bytes_in_per_sample"] > 0, out
    assert out["saturating_workers"] > 0, out
