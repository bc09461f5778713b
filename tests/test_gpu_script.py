"""bench/gpu.py --dry-run: the GPU script's code paths on a CPU with a tiny model (Triton kernels
in the interpreter, the graph runner's padding run eagerly), so it is ready for a GPU."""
import json
import os
import signal
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.gpu import compare, greedy_hf  # noqa: E402


def test_gpu_script_dry_run(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--dry-run", "--out", str(out),
           "--model-dir", str(tmp_path / "model")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "gpu.json").read_text())
    assert res["dry_run"] and res["correct"] and not res["errors"]
    kernels = res["kernels"]
    assert {k["kernel"] for k in kernels} == {"decode_attention", "extend_attention", "store_kv", "lora_add",
                                              "decode_attention window 37", "extend_attention window 37",
                                              "decode_attention window 37 softcap 5",
                                              "extend_attention window 37 softcap 5", "fused_moe",
                                              "w8_linear int8"}
    # 28 attention rows, and a LoRA, a MoE and an int8 row a dtype (fp8 only on a GPU that has it)
    assert len(kernels) == 34 and all(k["ok"] for k in kernels)
    g = res["greedy"]
    for pair in ("graphs_vs_eager", "graphs_vs_hf", "eager_vs_hf"):
        assert g[pair]["exact"] == g["prompts"] == 3, pair  # fp32 on a CPU: exact
    assert g["logits_rel_err"] < 1e-4
    steps = res["decode_steps"]["rows"]
    assert [(r["bs"], r["ctx"]) for r in steps] == [(1, 32), (2, 32), (3, 32), (3, 64)]
    assert all(r["eager_ms"] > 0 and r["graph_ms"] > 0 and r["bytes"] > res["decode_steps"]["weight_bytes"]
               for r in steps)
    o = res["step_overhead"]
    assert o["same_tokens"] and [(r["overlap"], r["bs"]) for r in o["rows"]] == [
        (False, 2), (False, 3), (True, 2), (True, 3)]
    assert all(r["steps"] > 0 and 0 <= r["not_forward"] < 1 and r["forward_ms"] > 0 for r in o["rows"])
    assert res["eight_bit"] == {"skipped": "8-bit weights run on a GPU"}
    t = res["tensor_parallel"]  # 2 ranks over gloo: fp32, the same tokens
    assert (t["ranks"], t["backend"], t["equal"], t["first_differ"]) == (2, "gloo", "8/8", [])
    assert t["tok_s_one"] > 0 and t["tok_s_two"] > 0
    tp = res["throughput"]
    assert tp["out_tokens"] > 0 and tp["ours_tok_s"] > 0 and tp["hf_tok_s"] > 0
    assert res["startup"]["graph_sizes"][0] == 1 and not res["startup"]["captured"]
    assert set(res["targets"]) == {"graph_speedup_bs1", "large_batch_bw_frac", "throughput_vs_hf"}
    assert res["vision"] == {"chats": 4, "images": [0, 1, 2, 3], "exact": 4}
    table = (out / "gpu.md").read_text()
    assert "dry run" in table and "| batch | context |" in table and "| overlap | batch |" in table
    assert "Tensor parallel, 2 ranks over gloo" in table


def test_greedy_adjudication_catches_a_wrong_token(tiny_models):
    """The script's near-tie rule: a token transformers rates far below its own pick is a
    mismatch, identical outputs are exact."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32).eval()
    cpu = torch.device("cpu")
    batch = [[5, 9, 11, 40], [7, 8, 100, 3, 3]]
    ref = [greedy_hf(hf, ids, 6, cpu) for ids in batch]
    with torch.no_grad():
        logits = hf(torch.tensor([batch[1] + ref[1][:3]])).logits[0, -1]
    worst = int(logits.argmin())  # far from a tie with transformers' pick
    bad = [ref[0], ref[1][:3] + [worst] + ref[1][4:]]
    got = compare(bad, ref, batch, hf, cpu, tol=0.15)
    assert (got["exact"], got["near_tie"], got["mismatch"]) == (1, 0, 1)
    assert got["worst_margin"] > 1.0


def test_a_run_killed_midway_keeps_the_sections_it_finished(tmp_path):
    """The files are rewritten after every section: kill -9 after the kernels' section (as a
    device's time limit or an OOM kill would) and the kernels' figures are there, whole."""
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--dry-run", "--out", str(out),
           "--model-dir", str(tmp_path / "model")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    try:
        deadline = time.monotonic() + 300
        while not (out / "gpu.json").exists() or "kernels" not in json.loads((out / "gpu.json").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    res = json.loads((out / "gpu.json").read_text())
    assert len(res["kernels"]) == 34 and all(k["ok"] for k in res["kernels"])  # 28 attention, 2 LoRA, 2 MoE, 2 int8
    assert "vision" not in res and not res["correct"]  # cut short: not all checks ran
    assert "34/34 ok" in (out / "gpu.md").read_text()
