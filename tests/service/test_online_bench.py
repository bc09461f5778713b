"""bench/online.py at a small size: the online requests' keys are gone after the grace."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_online_benchmark_runs_and_leaves_nothing(model_dir):
    # By its path, bench/ kept off sys.path: its datasets.py would hide Hugging Face's.
    spec = importlib.util.spec_from_file_location("bench_online", os.path.join(ROOT, "bench", "online.py"))
    online = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(online)
    out = online.run(model_dir, requests=60, clients=8, online_ttl=2)
    assert out["codes"] == {200: 54, 400: 6}, out["codes"]
    assert out["right_after"]["keys"] > out["before"]["keys"]  # the jobs were there
    assert out["after_grace"]["keys"] <= out["before"]["keys"] + 2 and out["keys_left"] == [], out
    assert out["ratio_after_grace"] < 1.5, out
