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
import time

import pytest
import torch

from worker.engine import Engine, EngineError, SamplingParams
from worker.engine.models.tiny import build_tiny_model
from worker.engine.parallel import TP, Split

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
