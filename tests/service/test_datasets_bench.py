"""bench/datasets.py at a small size: a dataset job end to end, its output read back whole."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_datasets_benchmark_runs_and_every_row_comes_back_once(model_dir, tmp_path):
    # By its path: `import datasets` may be Hugging Face's, loaded by another test already.
    spec = importlib.util.spec_from_file_location("bench_datasets", os.path.join(ROOT, "bench", "datasets.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    path = str(tmp_path / "rows.jsonl")
    bench.dataset(path, 300)
    out = bench.run(model_dir, path, 300, str(tmp_path), kill=False)
    assert out["wrong"] == [], out["wrong"]
    assert out["output_jsonl_rows_per_s"] > 0 and out["output_parquet_rows_per_s"] > 0
