"""Overlap scheduling (EngineConfig.overlap_schedule): a step's forward runs on a thread while
the previous step's fan-in runs on the engine's; the outputs are those of the serial engine.

Tokens, texts and finishes are compared exactly; logprobs to float rounding, since requests
join steps in another order (an n > 1 prompt's samples one step later), and a row's logits
move by ~1e-6 with what it is batched with, as in any two serial runs of different batches."""
import math
import random

import pytest

from worker.engine import Engine, SamplingParams


def ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


def workload(eng):
    """Greedy and sampled items, n > 1 (warm-ups), stop strings and stop tokens, logprobs and
    prompt logprobs, penalties, prompts long enough to be chunked; stop strings are taken from
    a first greedy run, so some requests end on one mid-decode."""
    greedy = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    probe = eng.generate(input_ids=[ids(8, 1), ids(30, 2)], sampling_params=greedy)
    stops = [s.samples[0].text[6:9] for s in probe]
    assert all(s.strip() for s in stops)
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5)
    return [(ids(8, 1), greedy.copy(stop=[stops[0]])),
            (ids(30, 2), greedy.copy(stop=[stops[1]], logprobs=True, top_logprobs=2)),
            (ids(70, 3), sp.copy(n=3)),
            (ids(12, 4), sp.copy(top_p=0.9, top_k=40, prompt_logprobs=2)),
            (ids(90, 5), sp.copy(n=2, repetition_penalty=1.2, min_new_tokens=4)),
            (ids(5, 6), sp.copy(stop_token_ids=[7, 9, 11, 13], max_new_tokens=30)),
            (ids(40, 7), greedy.copy(max_new_tokens=3))]


def run(eng, items, abort_at=None):
    events = {}
    eng.add("job", [(i, None, p) for i, (p, _) in enumerate(items)], [s for _, s in items],
            sink=lambda ev: events.setdefault((ev.index, ev.sample), []).append(ev))
    eng.add("other", [(0, None, ids(50, 9))], SamplingParams(max_new_tokens=40, n=2))
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        if steps == abort_at:
            assert eng.abort("other") == 2
        eng.check()
    out = {}
    for key, evs in events.items():
        (ev,) = [e for e in evs if e.finished]
        assert evs[-1] is ev and "".join(e.text_delta for e in evs) == ev.text
        assert [t for e in evs for t in e.token_ids_delta] == ev.token_ids
        out[key] = (ev.token_ids, ev.text, ev.finish_reason, ev.matched_stop,
                    ev.usage.prompt_tokens, ev.usage.completion_tokens,
                    flat(ev.logprobs), flat(ev.prompt_logprobs))
    return out


def flat(records):
    """A logprobs record list as (token ids, logprobs) to compare: ids exactly, values by close()."""
    if records is None:
        return None
    toks, vals = [], []
    for r in records:
        toks.append((r["token_id"], [t["token_id"] for t in r["top_logprobs"] or ()]))
        vals.append([r["logprob"]] + [t["logprob"] for t in r["top_logprobs"] or ()])
    return toks, vals


def same(a, b):
    """Outputs equal, logprob values within 1e-4."""
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][:6] == b[k][:6], k
        for x, y in zip(a[k][6:], b[k][6:]):
            assert (x is None) == (y is None), k
            if x is not None:
                assert x[0] == y[0], k
                for u, v in zip(x[1], y[1]):
                    assert len(u) == len(v) and all(
                        (p is None and q is None) or math.isclose(p, q, abs_tol=1e-4)
                        for p, q in zip(u, v)), k


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "retracting"])
def test_overlap_gives_the_serial_engines_outputs(llama_path, tight):
    kw = dict(max_prefill_tokens=32, page_size=4)
    if tight:
        kw["kv_tokens"] = 260  # retraction and eviction on the way
    serial = Engine(llama_path, **kw)
    items = workload(serial)
    want = run(serial, items, abort_at=5)
    overlap = Engine(llama_path, overlap_schedule=True, **kw)
    got = run(overlap, items, abort_at=5)
    same(got, want)
    assert sum(1 for v in want.values() if v[2] == "stop" and isinstance(v[3], str)) >= 2
    assert any(v[6] for v in want.values()) and any(v[7] for v in want.values())
    # Requests ended by a stop string while their next step ran: that step's token dropped.
    assert overlap.scheduler.dropped_tokens >= 2 and serial.scheduler.dropped_tokens == 0
    if tight:
        assert overlap.scheduler.num_retractions > 0
    overlap.check()


def test_overlap_streams_through_generate_and_ends_idle(llama_path):
    eng = Engine(llama_path, overlap_schedule=True)
    sp = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    want = Engine(llama_path).generate(input_ids=[ids(10, 1), ids(20, 2)], sampling_params=sp)
    events = list(eng.generate(input_ids=[ids(10, 1), ids(20, 2)], sampling_params=sp, stream=True))
    finals = {e.index: e.token_ids for e in events if e.finished}
    assert finals == {i: it.samples[0].token_ids for i, it in enumerate(want)}
    assert not eng.has_work()
    eng.check()
