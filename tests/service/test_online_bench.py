"""bench/online.py at a small size: the online requests' keys are gone after the grace."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def test_the_online_benchmark_runs_and_leaves_nothing(model_dir):
    import online  # bench/online.py
    out = online.run(model_dir, requests=60, clients=8, online_ttl=2)
    assert out["codes"] == {200: 54, 400: 6}, out["codes"]
    assert out["right_after"]["keys"] > out["before"]["keys"]  # the jobs were there
    assert out["after_grace"]["keys"] <= out["before"]["keys"] + 2, out
    assert out["ratio_after_grace"] < 1.5, out
