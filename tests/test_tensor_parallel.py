"""Tensor parallel on the CPU over gloo (worker/engine/parallel.py, ranks.py): an engine of 2
ranks, this process and one it starts, gives the tokens one rank gives, on random-weight
models whose split has something to get wrong:

- Llama with 1 KV head (replicated on both ranks) and a vocab of 501 (the second rank's
  embedding rows padded);
- Qwen3-MoE: every expert's rows split, the router replicated, a dense first layer, q/k norms;
- Gemma 3: tied, scaled embeddings, soft-capped logits, a sliding layer and a full one.

(A checkpoint whose q/k/v come fused, Phi-3's, is split as the others: the loader splits the
concatenated tensor either way.)

The prompts share prefixes and run in chunks of 16 tokens, so the second rank's
request-to-token rows come from the radix cache and from earlier chunks (ranks.Mirror),
and a second batch runs on what the first left cached. Logits differ between 1 and 2 ranks
by the order of the row-parallel sums only (float32 rounding)."""
import json
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from worker.engine import Engine, EngineError, SamplingParams
from worker.engine.models.tiny import build_tiny_model
from worker.engine.parallel import TP, Split
from worker.engine.ranks import GROUP_TIMEOUT

CASES = {
    "llama": dict(arch="llama", num_kv_heads=1, vocab_size=501),
    "qwen3_moe": dict(arch="qwen3_moe"),
    "gemma3": dict(arch="gemma3", tie_word_embeddings=True),
}
SHARED = "the quick brown fox jumps over the lazy dog while "
PROMPTS = [SHARED + tail for tail in ("def fibonacci(n):", "import os", "hello", "a b c d e f g")] + \
    ["short", "x" * 70]
ENGINE = dict(device="cpu", kv_tokens=4096, max_prefill_tokens=16, page_size=4)


def run(engine: Engine):
    greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=8, temperature=0.9, n=3, ignore_eos=True)
    first = engine.generate(PROMPTS, sampling_params=greedy)
    again = engine.generate(PROMPTS[::-1], sampling_params=[sampled] * len(PROMPTS), seed=5)
    ids = [engine.tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    return ([[s.token_ids for s in it.samples] for it in first + again], engine.prompt_logits(ids))


@pytest.fixture(scope="module", params=list(CASES))
def both(request, tmp_path_factory):
    """(one rank's outputs, two ranks')."""
    path = build_tiny_model(str(tmp_path_factory.mktemp(request.param) / "m"), **CASES[request.param])
    out = []
    for size in (1, 2):
        engine = Engine(path, tensor_parallel_size=size, **ENGINE)
        try:
            out.append(run(engine))
        finally:
            engine.close()
    return out


def test_two_ranks_give_one_ranks_tokens(both):
    (one, _), (two, _) = both
    assert two == one
    assert len(one) == 2 * len(PROMPTS) and all(len(t) == 16 for s in one[:len(PROMPTS)] for t in s)


def test_two_ranks_give_one_ranks_logits(both):
    (_, one), (_, two) = both
    for (s1, a), (s2, b) in zip(one, two):
        assert s1 == s2 and a.shape == b.shape
        assert (a - b).abs().max() < 1e-4 * a.abs().max()


def test_a_refused_split_then_a_dead_rank(tmp_path):
    """A split the model does not allow is refused by name, and leaves nothing behind: a good
    split starts after it. Its follower killed, the next step names it and raises
    EngineError (the worker then exits and gives its jobs back), within seconds, not the
    group's 10-minute timeout."""
    path = build_tiny_model(str(tmp_path / "m"), arch="llama")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide the model's 4 attention heads"):
        Engine(path, tensor_parallel_size=3, **ENGINE)
    engine = Engine(path, tensor_parallel_size=2, **ENGINE)
    try:
        assert len(engine.generate("hi", sampling_params=SamplingParams(max_new_tokens=2))) == 1
        follower = engine.runner.ranks.procs[0]
        follower.kill()
        follower.wait()
        t = time.monotonic()
        with pytest.raises(EngineError, match="tensor-parallel rank 1 .* exited"):
            engine.generate("hello again", sampling_params=SamplingParams(max_new_tokens=2))
        assert time.monotonic() - t < 60
    finally:
        engine.close()


# Rank 0 is the child's own process; the rank named on its command line gets an address
# space 32 MB over what it holds, then a 6,000-token prompt's prefill needs more (its MLP
# alone: 6,000 x 2,048 floats a rank, 49 MB).
FAULT = """
import json, resource, sys, time
from worker.engine import Engine, EngineError, SamplingParams
path, who = sys.argv[1], int(sys.argv[2])
engine = Engine(path, tensor_parallel_size=2, device="cpu", kv_tokens=8192, max_prefill_tokens=8192,
                page_size=4)
one = SamplingParams(max_new_tokens=2, ignore_eos=True)
engine.generate(input_ids=[[5] * 64], sampling_params=one)
follower = engine.runner.ranks.procs[0]
pid = follower.pid if who else 0
held = next(int(line.split()[1]) for line in open(f"/proc/{pid or 'self'}/status") if line.startswith("VmSize"))
resource.prlimit(pid, resource.RLIMIT_AS, ((held + 32 * 1024) * 1024, resource.RLIM_INFINITY))
t = time.monotonic()
try:
    engine.generate(input_ids=[[7] * 6000], sampling_params=one)
    out = {"error": None}
except EngineError as e:
    out = {"error": str(e)}
out["seconds"] = time.monotonic() - t
resource.prlimit(0, resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
t = time.monotonic()
engine.close()
out.update(close_seconds=time.monotonic() - t, follower_code=follower.returncode)
print(json.dumps(out))
"""


@pytest.mark.parametrize("who", [1, 0])
def test_a_forward_that_fails_on_one_rank_ends_the_group_at_once(tmp_path, who):
    """A forward that raises on one rank alone (here: out of memory) leaves the other in a
    collective; the group ends within seconds, not at its 10-minute timeout
    (ranks.GROUP_TIMEOUT): a follower that fails exits and rank 0 names it; rank 0 failing
    kills the followers and names its own error. Either way the engine raises EngineError
    (the worker then gives its jobs back), and closes at once."""
    path = build_tiny_model(str(tmp_path / "m"), hidden_size=512, intermediate_size=2048, max_context=8192)
    child = subprocess.run([sys.executable, "-c", FAULT, path, str(who)], capture_output=True, text=True,
                           timeout=GROUP_TIMEOUT.total_seconds())
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.splitlines()[-1])
    bound = GROUP_TIMEOUT.total_seconds() / 10
    assert out["seconds"] < bound and out["close_seconds"] < bound, out
    if who:
        assert re.search(r"tensor-parallel rank 1 \(pid \d+\) exited with code 1", out["error"]), out
        assert "forward failed; this rank exits" in child.stderr and out["follower_code"] == 1
    else:
        assert "tensor parallel: rank 0's forward failed" in out["error"], out
        assert "allocate" in out["error"] and out["follower_code"] == -signal.SIGKILL, out


def test_what_is_not_split_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size: LoRA adapters are not split"):
        Engine(str(tmp_path), tensor_parallel_size=2, max_loras=1)
    with pytest.raises(ValueError, match="tensor_parallel_size: must be >= 1"):
        Engine(str(tmp_path), tensor_parallel_size=0)


def test_kv_heads_fewer_than_ranks_must_divide_them():
    from worker.engine.models.config import ModelConfig
    cfg = ModelConfig("LlamaForCausalLM", 64, 128, 2, 4, 3, 16, 512, 1e-5, 1e4, None, 64)
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 is not a multiple of the model's 3 KV heads"):
        TP(0, 4).local(cfg)
    local = TP(1, 2).local(ModelConfig("LlamaForCausalLM", 64, 128, 2, 4, 1, 16, 512, 1e-5, 1e4, None, 64))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)


def test_split_takes_each_range_and_pads():
    w = torch.arange(10.0).view(5, 2)
    assert Split(0, ((0, 1), (3, 5))).take(w).tolist() == [[0, 1], [6, 7], [8, 9]]
    assert Split(0, ((3, 5),), rows=3).take(w).tolist() == [[6, 7], [8, 9], [0, 0]]
    assert Split(1, ((1, 2),)).take(w).flatten().tolist() == [1, 3, 5, 7, 9]
    assert [TP(r, 2).vocab(501) for r in (0, 1)] == [(0, 251, 251), (251, 501, 251)]
