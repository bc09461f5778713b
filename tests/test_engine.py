"""The engine against Hugging Face transformers on the same weights, and its scheduling."""
import json
import os
import random
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from worker.engine import Engine, SamplingParams

LOGIT_TOL = 5e-4  # fp32, max abs difference; logits here span about +-15


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts_ids(n, lo, hi, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def hf_greedy(model, ids, max_new):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                             min_new_tokens=max_new, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "qwen2_window", "phi3", "mixtral",
                                  "qwen3_moe", "gemma2", "gemma3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_teacher_forced_logits(tiny_models, arch, page_size):
    path = tiny_models[arch]
    hf = hf_model(path)
    vocab = hf.config.vocab_size
    # Small prefill budget: prompts over 48 tokens are chunked across steps.
    eng = Engine(path, page_size=page_size, max_prefill_tokens=48)
    shared = prompts_ids(1, 40, 41, vocab, seed=1)[0]
    batch = prompts_ids(4, 5, 120, vocab) + [shared + [5, 6, 7]]
    got = eng.prompt_logits(batch)
    # Second pass: shared prefix comes from the radix cache.
    again = eng.prompt_logits([shared + [9, 10], batch[1]])
    assert again[0][0] >= (len(shared) // page_size) * page_size > 0
    assert again[1][0] > 0
    with torch.no_grad():
        for ids, (start, logits) in list(zip(batch, got)) + list(zip([shared + [9, 10], batch[1]], again)):
            ref = hf(torch.tensor([ids])).logits[0, start:]
            assert logits.shape == ref.shape
            assert (logits - ref).abs().max().item() < LOGIT_TOL
    eng.check()


PROMPT_LP_TOL = 1e-4  # the bound on prompt logprobs against transformers


def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """Of ids[1:] given what comes before each: transformers' log_softmax, teacher-forced."""
    with torch.no_grad():
        lsm = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return lsm[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0], lsm[:-1]


def test_prompt_logprobs_match_transformers_through_chunks_the_cache_samples_and_retraction(tiny_models):
    """Prompt logprobs equal transformers' (1e-4) for chunked prompts; a prompt whose prefix
    is in the radix cache still gets all of them (it recomputes the prefix: say so by the
    counters); n > 1 scores the prompt once; a pool small enough to retract changes nothing."""
    path = tiny_models["llama"]
    hf = hf_model(path)
    vocab = hf.config.vocab_size
    shared = prompts_ids(1, 70, 71, vocab, seed=5)[0]
    batch = [shared + [5, 6, 7], shared + [9, 10, 11, 12]] + prompts_ids(3, 2, 130, vocab, seed=6)
    eng = Engine(path, page_size=4, max_prefill_tokens=48)
    eng.generate(input_ids=[shared + [1, 2]], sampling_params=SamplingParams(max_new_tokens=1))  # cache it
    sp = SamplingParams(max_new_tokens=3, temperature=0, prompt_logprobs=3, n=2)
    before = eng.stats().prefill_tokens
    out = eng.generate(input_ids=batch, sampling_params=sp)
    # Every prompt went through the forward in full (its warm-up), however much of it the
    # cache held; its samples then find it cached but for the last, unaligned page.
    ran = eng.stats().prefill_tokens - before
    assert sum(map(len, batch)) <= ran <= sum(map(len, batch)) + 2 * len(batch) * 4
    for ids, item in zip(batch, out):
        ref, lsm = hf_prompt_logprobs(hf, ids)
        for s in item.samples:
            got = s.prompt_logprobs
            assert [r["token_id"] for r in got] == ids
            assert got[0]["logprob"] is None and got[0]["top_logprobs"] is None
            values = torch.tensor([r["logprob"] for r in got[1:]])
            assert (values - ref).abs().max().item() < PROMPT_LP_TOL
            tops = torch.tensor([[t["logprob"] for t in r["top_logprobs"]] for r in got[1:]])
            assert (tops - lsm.topk(3, dim=-1).values).abs().max().item() < PROMPT_LP_TOL
        assert item.samples[0].prompt_logprobs == item.samples[1].prompt_logprobs
    # Scoring only (max_new_tokens 0), n = 1, in a pool so small requests retract.
    small = Engine(path, page_size=1, kv_tokens=200, max_prefill_tokens=32)
    scored = small.generate(input_ids=batch, sampling_params=SamplingParams(max_new_tokens=0, prompt_logprobs=0))
    for ids, item in zip(batch, scored):
        s = item.samples[0]
        assert s.token_ids == [] and s.finish_reason == "length"
        ref, _ = hf_prompt_logprobs(hf, ids)
        assert (torch.tensor([r["logprob"] for r in s.prompt_logprobs[1:]]) - ref).abs().max().item() < PROMPT_LP_TOL
        assert all(r["top_logprobs"] == [] for r in s.prompt_logprobs[1:])
    mixed = small.generate(input_ids=batch, sampling_params=[
        SamplingParams(max_new_tokens=40, ignore_eos=True, prompt_logprobs=1 if i % 2 else None)
        for i in range(len(batch))])
    assert small.scheduler.num_retractions > 0
    for i, (ids, item) in enumerate(zip(batch, mixed)):
        got = item.samples[0].prompt_logprobs
        if i % 2 == 0:
            assert got is None
            continue
        ref, _ = hf_prompt_logprobs(hf, ids)
        assert (torch.tensor([r["logprob"] for r in got[1:]]) - ref).abs().max().item() < PROMPT_LP_TOL
    small.check()
    eng.check()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "qwen2_window", "phi3", "mixtral",
                                  "qwen3_moe", "gemma2", "gemma3"])
def test_greedy_matches_transformers(tiny_models, arch):
    path = tiny_models[arch]
    hf = hf_model(path)
    batch = prompts_ids(16, 3, 60, hf.config.vocab_size, seed=2)
    max_new = 12
    ref = [hf_greedy(hf, ids, max_new) for ids in batch]
    # min_new_tokens masks EOS exactly as transformers does.
    sp = SamplingParams(max_new_tokens=max_new, min_new_tokens=max_new, temperature=0)
    eng = Engine(path, page_size=16)
    out = eng.generate(input_ids=batch, sampling_params=sp)
    assert [it.samples[0].token_ids for it in out] == ref
    # A tiny KV pool forces retraction; outputs must not change.
    small = Engine(path, page_size=1, kv_tokens=160, max_prefill_tokens=64)
    out2 = small.generate(input_ids=batch, sampling_params=sp)
    assert small.scheduler.num_retractions > 0
    assert [it.samples[0].token_ids for it in out2] == ref
    small.check()


def test_seeded_sampling_reproducible(llama_path):
    eng = Engine(llama_path)
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.95, top_k=50, n=4, seed=7)
    prompts = ["hello world", "the quick brown fox", "import os"]
    alone = eng.generate(prompts=prompts[:1], sampling_params=sp)
    bigger = eng.generate(prompts=prompts, sampling_params=sp)
    assert [s.token_ids for s in alone[0].samples] == [s.token_ids for s in bigger[0].samples]
    assert len({tuple(s.token_ids) for s in bigger[0].samples}) > 1  # samples differ
    # Another order: item indices change, so pin each prompt's index with explicit items.
    box = []
    eng.add("t", [(2, prompts[2], None), (0, prompts[0], None), (1, prompts[1], None)], sp,
            seed=7, sink=box.append)
    while sum(e.finished for e in box) < 12:
        eng.step()
    finals = {(e.index, e.sample): e.token_ids for e in box if e.finished}
    for it in bigger:
        for j, s in enumerate(it.samples):
            assert finals[(it.index, j)] == s.token_ids
    other = eng.generate(prompts=prompts[:1], sampling_params=sp.copy(seed=8))
    assert [s.token_ids for s in other[0].samples] != [s.token_ids for s in alone[0].samples]


def test_item_with_its_own_seed_samples_the_same_anywhere(llama_path):
    eng = Engine(llama_path)
    base = SamplingParams(max_new_tokens=8, temperature=1.0, n=3)
    own = base.copy(seed=11)
    others = ["hello world", "the quick brown fox", "import os"]
    alone = eng.generate(prompts=["once upon"], sampling_params=[own])[0]
    # Same item at index 2 of another batch, next to items sampled from a job seed.
    mixed = eng.generate(prompts=others[:2] + ["once upon"] + others[2:],
                         sampling_params=[base, base, own, base], seed=5)
    assert [s.token_ids for s in mixed[2].samples] == [s.token_ids for s in alone.samples]
    assert len({tuple(s.token_ids) for s in alone.samples}) > 1  # its samples still differ
    # Items without their own seed keep the job rule: (job seed, index, sample).
    again = eng.generate(prompts=others[:2] + ["x"] + others[2:], sampling_params=[base] * 4, seed=5)
    assert [[s.token_ids for s in it.samples] for i, it in enumerate(again) if i != 2] == \
        [[s.token_ids for s in it.samples] for i, it in enumerate(mixed) if i != 2]
    # One shared object's seed is the job seed, not a seed per item: items differ.
    shared = eng.generate(prompts=["once upon", "once upon"], sampling_params=base.copy(seed=11))
    assert [s.token_ids for s in shared[0].samples] != [s.token_ids for s in shared[1].samples]
    assert [s.token_ids for s in shared[0].samples] == \
        [s.token_ids for s in eng.generate(prompts=["once upon"], sampling_params=base, seed=11)[0].samples]


def test_parallel_sampling_warms_prefix_once(llama_path):
    eng = Engine(llama_path, page_size=1)
    ids = prompts_ids(2, 200, 201, 500, seed=3)
    before = eng.scheduler.prefill_tokens_total
    out = eng.generate(input_ids=ids, sampling_params=SamplingParams(max_new_tokens=4, n=8, seed=1))
    prefilled = eng.scheduler.prefill_tokens_total - before
    # Two warm-ups of 200 tokens, then each of 16 samples prefills only its last prompt token.
    assert eng.front.warmup_count == 2
    assert prefilled == 2 * 200 + 16 * 1
    for it in out:
        for s in it.samples:
            assert s.usage.cached_tokens == 199 and s.usage.prompt_tokens == 200
            assert s.usage.completion_tokens == 4


def test_stream_rebuilds_text_and_stop_strings(llama_path):
    eng = Engine(llama_path)
    sp = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    full = eng.generate(prompts=["one two three"], sampling_params=sp)[0].samples[0]
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    assert stop.strip()
    events = list(eng.generate(prompts=["one two three", "four"], sampling_params=sp.copy(stop=[stop]),
                               stream=True))
    text = "".join(e.text_delta for e in events if e.index == 0)
    final = [e for e in events if e.index == 0 and e.finished][0]
    assert final.finish_reason == "stop" and final.matched_stop == stop
    assert text == final.text == full.text[:full.text.index(stop)]
    # No delta ever carries text past the stop point.
    acc = ""
    for e in (e for e in events if e.index == 0):
        acc += e.text_delta
        assert full.text.startswith(acc)
        assert stop not in acc


def test_too_long_prompt_fails_alone_and_abort_frees_kv(llama_path):
    eng = Engine(llama_path)
    too_long = [5 + i % 100 for i in range(eng.max_context + 5)]
    out = eng.generate(input_ids=[[5, 6, 7], too_long, [5, 10**6]],
                       sampling_params=SamplingParams(max_new_tokens=4, temperature=0))
    assert out[0].samples[0].finish_reason == "length"
    assert out[1].samples[0].finish_reason == "error" and "context" in out[1].samples[0].error
    assert out[2].samples[0].finish_reason == "error" and "vocabulary" in out[2].samples[0].error
    # Abort mid-run: KV released at once, nothing leaks.
    eng.add("job", [(0, "hello there", None), (1, "general kenobi", None)],
            SamplingParams(max_new_tokens=200, ignore_eos=True, n=2), seed=1)
    for _ in range(5):
        eng.step()
    assert eng.kv_manager.alloc.num_free < eng.kv_manager.alloc.total
    assert eng.abort("job") == 4
    eng.check()
    assert not eng.scheduler.running and not eng.scheduler.waiting
    evs = eng.step()
    assert sum(e.finished and e.finish_reason == "abort" for e in evs) == 4


def test_a_text_past_what_the_context_can_hold_fails_without_being_tokenized(llama_path):
    """bound.py: a 30 MB prompt fails its item in no time (the tokenizer never sees it); a
    text just under the bound is tokenized and judged by its tokens as before."""
    import time

    eng = Engine(llama_path)
    bound = eng.front.chats.bound
    calls = []
    encoder = eng.front.text.encode.__self__  # the text intake thread's own
    tokenize = encoder.tokenize
    encoder.tokenize = lambda texts: calls.append(texts) or tokenize(texts)
    huge = "x" * (30 * 1024 * 1024)
    t = time.perf_counter()
    out = eng.generate(prompts=["hello", huge], sampling_params=SamplingParams(max_new_tokens=2))
    took = time.perf_counter() - t
    assert out[0].samples[0].finish_reason == "length"
    err = out[1].samples[0]
    assert err.finish_reason == "error" and "not tokenized" in err.error and str(bound.max_bytes) in err.error
    assert all(huge not in texts for texts in calls)
    print(f"30 MB prompt refused in {took:.3f}s (bound {bound.max_bytes} bytes)")
    # A chat renders to text first: the same bound, the same error, its item alone.
    out = eng.generate(messages=[[{"role": "user", "content": huge}], [{"role": "user", "content": "hi"}]],
                       sampling_params=SamplingParams(max_new_tokens=2))
    assert "not tokenized" in out[0].samples[0].error and out[1].samples[0].finish_reason == "length"
    # Under the bound: tokenized, then too many tokens for the context, as any long prompt.
    near = "ab " * (bound.max_bytes // 3 - 1)
    out = eng.generate(prompts=[near], sampling_params=SamplingParams(max_new_tokens=2))
    assert "context" in out[0].samples[0].error and "not tokenized" not in out[0].samples[0].error


def test_bad_params_named():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=-1)


@pytest.mark.parametrize("page_size", [1, 16])
def test_parallel_greedy_samples_match_transformers(tiny_models, page_size):
    """n > 1 samples share the cached prompt (attended once for the group): greedy samples
    must each equal transformers' greedy output."""
    path = tiny_models["qwen2"]
    hf = hf_model(path)
    batch = prompts_ids(2, 150, 200, hf.config.vocab_size, seed=5)
    ref = [hf_greedy(hf, ids, 10) for ids in batch]
    eng = Engine(path, page_size=page_size)
    out = eng.generate(input_ids=batch, sampling_params=SamplingParams(
        max_new_tokens=10, min_new_tokens=10, temperature=0, n=3))
    for it, want in zip(out, ref):
        assert [s.token_ids for s in it.samples] == [want] * 3


def test_in_batch_prefix_shared_once(llama_path):
    """Prompts sharing an uncached prefix, admitted together, compute it once."""
    eng = Engine(llama_path, page_size=1)
    shared = prompts_ids(1, 300, 301, 500, seed=4)[0]
    batch = [shared + [10 + i] * 5 for i in range(4)]
    eng.generate(input_ids=batch, sampling_params=SamplingParams(max_new_tokens=2, temperature=0))
    assert eng.scheduler.prefill_tokens_total == 305 + 3 * 5 + 2 * 0  # decode tokens not counted


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_match_transformers(tiny_models, temperature):
    """Each token's logprob and its top 5 (ids, order, values) are transformers' log_softmax
    of the logits teacher-forced on prompt + output, greedy or sampled."""
    path = tiny_models["llama"]
    hf = hf_model(path)
    ids, other = prompts_ids(2, 20, 21, hf.config.vocab_size, seed=6)
    eng = Engine(path)
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=temperature, seed=3,
                        logprobs=True, top_logprobs=5)
    # Next to an item that does not ask: its rows pay nothing and it gets none.
    events = list(eng.generate(input_ids=[ids, other], stream=True,
                               sampling_params=[sp, sp.copy(logprobs=False, top_logprobs=0)]))
    final = next(ev for ev in events if ev.finished and ev.index == 0)
    assert next(ev for ev in events if ev.finished and ev.index == 1).logprobs is None
    assert [r for ev in events if ev.index == 0 for r in ev.logprobs_delta] == final.logprobs
    out, lps = final.token_ids, final.logprobs
    assert len(out) == 8 and [r["token_id"] for r in lps] == out
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1], -1)
    want = ref[torch.arange(8), torch.tensor(out)]
    assert torch.allclose(torch.tensor([r["logprob"] for r in lps]), want, atol=1e-4)
    top = ref.topk(5, dim=-1)
    assert [[t["token_id"] for t in r["top_logprobs"]] for r in lps] == top.indices.tolist()
    got = torch.tensor([[t["logprob"] for t in r["top_logprobs"]] for r in lps])
    assert torch.allclose(got, top.values, atol=1e-4)
    tok = eng.tokenizer
    assert all(t["token"] == tok.decode([t["token_id"]]) for r in lps for t in [r, *r["top_logprobs"]])
    is_best = [r["token_id"] == r["top_logprobs"][0]["token_id"] for r in lps]
    # Greedy picks the best raw token; sampling at temperature 1 does not always.
    assert all(is_best) if temperature == 0 else not all(is_best)
    # The non-streamed result carries the same records (alone in its batch: float noise apart).
    again = eng.generate(input_ids=[ids], sampling_params=[sp])[0].samples[0]
    assert again.token_ids == out and len(again.logprobs) == 8
    assert torch.allclose(torch.tensor([r["logprob"] for r in again.logprobs]), want, atol=1e-4)


@pytest.mark.parametrize("page_size", [1, 16])
def test_stress_small_pool_matches_big_pool(llama_path, page_size):
    """Shared prefixes, n > 1, chunked prefill, retraction and aborts together: greedy
    outputs equal a roomy engine's, and the KV invariant holds after every step."""
    rng = random.Random(page_size)
    base = prompts_ids(1, 120, 121, 500, seed=9)[0]
    batch = [base[:rng.randrange(20, 120)] + prompts_ids(1, 1, 30, 500, seed=i)[0] for i in range(12)]
    sps = [SamplingParams(max_new_tokens=rng.randrange(4, 30), min_new_tokens=4, temperature=0,
                          n=rng.choice([1, 1, 2])) for _ in batch]
    roomy = Engine(llama_path, page_size=page_size)
    want = roomy.generate(input_ids=batch, sampling_params=sps)
    tight = Engine(llama_path, page_size=page_size, kv_tokens=240, max_prefill_tokens=40)
    box = []
    tight.add("keep", [(i, None, ids) for i, ids in enumerate(batch)], sps, sink=box.append)
    tight.add("drop", [(0, None, base + [1, 2, 3])], SamplingParams(max_new_tokens=50, n=2))
    steps = 0
    while tight.has_work():
        tight.step()
        steps += 1
        if steps == 6:
            assert tight.abort("drop") == 2
        tight.check()
    got = {(e.index, e.sample): e.token_ids for e in box if e.finished}
    assert tight.scheduler.num_retractions > 0
    for it in want:
        for j, s in enumerate(it.samples):
            assert got[(it.index, j)] == s.token_ids


def test_fair_shares_let_a_small_owner_join_a_full_engine(llama_path):
    """Owner A's long samples fill every slot; owner B's two items join at once (A's newest
    requests are retracted to give B its share), B ends while A still runs, and A's samples
    are token for token what they are without B."""
    sp_a = SamplingParams(max_new_tokens=120, temperature=0.9, ignore_eos=True)
    sp_b = SamplingParams(max_new_tokens=4, ignore_eos=True)
    a_items = [(i, f"bulk item {i}", None) for i in range(16)]
    alone = Engine(llama_path, max_running=16)
    ref = {(ev.index, ev.sample): ev.token_ids for ev in alone.generate(
        prompts=[p for _, p, _ in a_items], sampling_params=sp_a, seed=3, stream=True) if ev.finished}

    eng = Engine(llama_path, max_running=16)
    got: dict = {}
    box: list = []
    eng.add("a", a_items, sp_a, seed=3, sink=box.append)
    while len(eng.scheduler.running) < 16 or eng.scheduler.waiting:
        eng.step()
    assert not eng.has_room() and eng.has_room_for_owner()
    eng.add("b", [(0, "small one", None), (1, "small two", None)], sp_b, seed=5, sink=box.append)
    while len(eng.front.text):  # tokenized on the intake thread, however long that takes here
        eng.step()
    steps = 0
    while sum(ev.finished for ev in box if ev.tag == "b") < 2:
        eng.step()
        steps += 1
        # B never waits beyond its share, and the slots stay bounded.
        assert len(eng.scheduler.running) <= 16
    assert steps <= 6  # admitted at the next step (its prefill gives the first token), then 3 more
    assert eng.scheduler.num_retractions == 2
    assert not any(ev.finished for ev in box if ev.tag == "a")  # A still runs
    while sum(ev.finished for ev in box if ev.tag == "a") < 16:
        eng.step()
    for ev in box:
        if ev.tag == "a":
            got.setdefault((ev.index, ev.sample), []).extend(ev.token_ids_delta)
    assert got == ref
    eng.check()


def test_step_shares_keep_a_small_owners_steps_short_and_the_big_one_takes_turns(llama_path):
    """Owner A runs 24 long samples; beside owner B's 2 items, each step holds at most
    step_share (4) of A's requests (B's steps stay short), A's requests take turns (none
    falls behind the others by more than a step's worth), B ends while A runs, and A's
    samples are token for token what they are alone. Alone, A runs whole steps again."""
    sp_a = SamplingParams(max_new_tokens=80, temperature=0.9, ignore_eos=True)
    sp_b = SamplingParams(max_new_tokens=30, ignore_eos=True)
    a_items = [(i, f"bulk item {i}", None) for i in range(24)]
    alone = Engine(llama_path, max_running=32)
    ref = {(ev.index, ev.sample): ev.token_ids for ev in alone.generate(
        prompts=[p for _, p, _ in a_items], sampling_params=sp_a, seed=3, stream=True) if ev.finished}

    eng = Engine(llama_path, max_running=32, step_share=4)
    sched = eng.scheduler
    box: list = []
    eng.add("a", a_items, sp_a, seed=3, sink=box.append)
    while len(sched.running) < 24 or sched.waiting:
        eng.step()
    a_reqs = list(sched.running)
    eng.add("b", [(0, "small one", None), (1, "small two", None)], sp_b, seed=5, sink=box.append)
    while len(eng.front.text):  # tokenized on the intake thread, however long that takes here
        eng.step()
    before = {r.rid: len(r.output_ids) for r in a_reqs}
    steps = 0
    while sum(ev.finished for ev in box if ev.tag == "b") < 2:
        eng.step()
        steps += 1
        ran = [r for r in a_reqs if r.ran_at == sched.steps]
        assert len(ran) <= 4, f"step {steps}: {len(ran)} of A's requests ran beside B"
    assert steps >= 29  # B's first token may come with its prefill in the loop above
    gained = [len(r.output_ids) - before[r.rid] for r in a_reqs]
    assert sum(gained) <= 4 * steps
    assert max(gained) - min(gained) <= 1, gained  # turns: least recently run first
    assert not any(ev.finished for ev in box if ev.tag == "a")
    eng.step()
    assert sum(r.ran_at == sched.steps for r in a_reqs) == 24  # alone again: the whole step
    while sum(ev.finished for ev in box if ev.tag == "a") < 24:
        eng.step()
    got: dict = {}
    for ev in box:
        if ev.tag == "a":
            got.setdefault((ev.index, ev.sample), []).extend(ev.token_ids_delta)
    assert got == ref
    eng.check()


def test_a_text_the_tokenizer_cannot_take_fails_its_item_alone(llama_path):
    """The second wall behind the API's check: a lone surrogate (what JSON's "\\ud800"
    makes) in a prompt or a chat, given to the engine directly, fails its item with a clear
    error; the items tokenized with it in one call still run."""
    eng = Engine(llama_path)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)  # sampled (no seed): no EOS can end one early
    out = eng.generate(prompts=["hello", "bad \ud800", "world"], sampling_params=sp)
    assert [it.samples[0].finish_reason for it in out] == ["length", "error", "length"]
    assert "tokenizer cannot take" in out[1].samples[0].error
    out = eng.generate(messages=[[{"role": "user", "content": "hi"}], [{"role": "user", "content": "bad \ud800"}],
                                 [{"role": "user", "content": [{"type": "text", "text": "ok"}]}]], sampling_params=sp)
    assert [it.samples[0].finish_reason for it in out] == ["length", "error", "length"]
    assert out[1].samples[0].error.startswith("messages[1]: cannot be encoded")
    eng.check()


def test_freeze_gc_takes_a_loaded_engine_out_of_the_full_collections(llama_path):
    """In a process of its own, as the worker: what the engine, torch and the tokenizer made
    is frozen, a full collection then walks only what came later, and the engine still gives
    the tokens it gave before."""
    code = f"""
import gc, json
from worker.engine import Engine, SamplingParams, freeze_gc
engine = Engine({llama_path!r}, device="cpu")
sp = SamplingParams(max_new_tokens=8, temperature=0)
before = engine.generate(prompts=["hello there"], sampling_params=sp)[0].samples[0].token_ids
tracked = len(gc.get_objects())
frozen = freeze_gc()
again = engine.generate(prompts=["hello there"], sampling_params=sp)[0].samples[0].token_ids
print(json.dumps(dict(tracked=tracked, frozen=frozen, after=len(gc.get_objects()), same=again == before)))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["tracked"] > 100_000 and got["frozen"] >= got["tracked"] // 2, got
    assert got["after"] < got["tracked"] // 100 and got["same"], got


def test_threads_sets_torchs_cpu_threads(llama_path):
    """--threads (EngineConfig.threads): the process's torch threads; none given, torch's own."""
    from worker.engine import EngineConfig
    before = torch.get_num_threads()
    try:
        Engine(llama_path, threads=1, kv_tokens=256)
        assert torch.get_num_threads() == 1
        Engine(llama_path, kv_tokens=256)
        assert torch.get_num_threads() == 1  # left as it was
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads: must be >= 1"):
        EngineConfig(threads=0)
