"""Fault isolation inside an engine step: a request whose step raises ends alone with an
error; the rest of the batch gets exactly its tokens; a fault no request explains raises
EngineError and leaves the engine consistent.

Faults are injected around the real parts (model forward, sampler, detokenizer): each wrapper
raises only for a batch holding a marked request and otherwise runs the real code.
"""
import logging
import random

import pytest

from worker.engine import Engine, EngineError, SamplingParams
from worker.engine import front
from worker.engine.detokenizer import Detokenizer

MARKER = 500  # a prompt token that poisons the forward at a position >= FAR
FAR = 200  # innocent requests never reach this position, so never feed MARKER there
POISON = 499  # a stop_token_ids value that poisons the sampler
CHUNK = 32  # max_prefill_tokens: the long prompts are prefilled in chunks


def ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


def innocents():
    """Seven items: short and long (chunked) prompts, greedy and sampled, n > 1, penalties,
    logprobs; each with its own seed, so its samples are the same wherever it sits."""
    sp = SamplingParams(max_new_tokens=12, temperature=1.0)
    items = [(ids(6, 0), sp.copy(temperature=0, ignore_eos=True, seed=10)),
             (ids(70, 1), sp.copy(max_new_tokens=10, seed=11)),
             (ids(9, 2), sp.copy(n=3, seed=12)),
             (ids(60, 3), sp.copy(max_new_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
                                  seed=13)),
             (ids(4, 4), sp.copy(max_new_tokens=16, top_k=20, temperature=0.8, ignore_eos=True,
                                 seed=14)),
             (ids(170, 5), sp.copy(max_new_tokens=10, n=2, seed=15)),
             (ids(20, 6), sp.copy(repetition_penalty=1.3, seed=16))]
    assert all(len(p) + s.max_new_tokens < FAR for p, s in items)
    return items


def engine(path, overlap=False):
    return Engine(path, max_prefill_tokens=CHUNK, overlap_schedule=overlap)


def reference(path, items):
    """Each item's samples from an engine without faults: [[token ids per sample]]."""
    out = engine(path).generate(input_ids=[p for p, _ in items],
                                sampling_params=[s for _, s in items])
    return [[s.token_ids for s in it.samples] for it in out]


def poison(eng, monkeypatch, where):
    """Wrap eng's real forward and sampler. where="forward": a batch feeding MARKER at a
    position >= FAR raises; where="sampler": a batch sampling a request that has POISON in
    its stop_token_ids and 2 tokens already raises. Returns the new-token counts of each
    batch that raised."""
    failed, last = [], []
    real_forward, real_sampler = eng.runner.forward, eng.executor.sampler

    def forward(fb):
        last[:] = fb.extend_lens_cpu
        if where == "forward" and ((fb.input_ids == MARKER) & (fb.positions >= FAR)).any():
            failed.append(list(last))
            raise RuntimeError("poisoned token")
        return real_forward(fb)

    def sampler(logits, reqs):
        if where == "sampler" and any(POISON in r.params.stop_token_ids and len(r.output_ids) >= 2
                                      for r in reqs):
            failed.append(list(last))
            raise OverflowError("Overflow when unpacking long long")
        return real_sampler(logits, reqs)

    monkeypatch.setattr(eng.runner, "forward", forward)
    monkeypatch.setattr(eng.executor, "sampler", sampler)
    return failed


def run(eng, items):
    """Run items (index = position) to the end, checking the KV invariant after every step;
    returns {(index, sample): [events]}."""
    events = {}
    eng.add("job", [(i, None, p) for i, (p, _) in enumerate(items)], [s for _, s in items],
            sink=lambda ev: events.setdefault((ev.index, ev.sample), []).append(ev))
    while eng.has_work():
        eng.step()
        eng.check()
    return events


def final(evs):
    """The one final event of a sample, after its deltas, which add up to it."""
    (ev,) = [e for e in evs if e.finished]
    assert evs[-1] is ev and "".join(e.text_delta for e in evs) == ev.text
    assert [t for e in evs for t in e.token_ids_delta] == ev.token_ids
    return ev


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("where", ["sampler", "forward"])
def test_poisoned_request_fails_alone(llama_path, monkeypatch, caplog, where, overlap):
    caplog.set_level(logging.ERROR, "fanout.engine")
    good = innocents()
    want = reference(llama_path, good)
    if where == "sampler":  # two items, each failing at its 3rd token, mid-decode
        sp = SamplingParams(max_new_tokens=10, ignore_eos=True, stop_token_ids=[POISON])
        bad = [(ids(12, 7), sp.copy(seed=17)), (ids(7, 8), sp.copy(seed=18))]
        culprits, kind, made = [(3, 0), (4, 0)], "OverflowError", 2
    else:  # n = 2: its warm-up fails in a later prefill chunk, after earlier chunks were cached
        bad = [(ids(FAR + 5, 7) + [MARKER] + ids(4, 8), SamplingParams(max_new_tokens=10, n=2, seed=17))]
        culprits, kind, made = [(3, 0), (3, 1)], "RuntimeError", 0
    eng = engine(llama_path, overlap)
    failed = poison(eng, monkeypatch, where)
    got = run(eng, good[:3] + bad + good[3:])

    # The first failing step mixed decode rows with prefill rows, of several requests.
    lens = failed[0]
    assert len(lens) >= 5 and 1 in lens and max(lens) > 1
    for key in culprits:
        ev = final(got[key])
        assert ev.finish_reason == "error" and len(ev.token_ids) == made
        assert ev.error.startswith(f"internal error in engine step: {kind}")
    blamed = [r for r in caplog.records if "failed alone" in r.getMessage()]
    assert len(blamed) == len(bad)  # in the forward case the warm-up, for both samples
    assert all(r.exc_info and r.exc_info[0].__name__ == kind for r in blamed)
    for i, samples in enumerate(want):
        k = i if i < 3 else i + len(bad)
        assert [final(got[(k, j)]).token_ids for j in range(len(samples))] == samples
        assert all(final(got[(k, j)]).finish_reason != "error" for j in range(len(samples)))
    eng.check()
    # It keeps serving: new requests, poisoned or not, behave the same.
    again = eng.generate(input_ids=[good[0][0], bad[0][0], good[2][0]],
                         sampling_params=[good[0][1], bad[0][1], good[2][1]])
    assert again[0].samples[0].token_ids == want[0][0]
    assert {s.finish_reason for s in again[1].samples} == {"error"}
    assert [s.token_ids for s in again[2].samples] == want[2]
    eng.check()


def test_lone_poisoned_request_fails_alone(llama_path, monkeypatch):
    """Alone in the engine it cannot be told from a broken engine by bisection: a probe step
    tells (it runs), so the request fails and the engine goes on."""
    eng = engine(llama_path)
    poison(eng, monkeypatch, "sampler")
    out = eng.generate(input_ids=[ids(5, 0)], sampling_params=SamplingParams(
        max_new_tokens=8, ignore_eos=True, stop_token_ids=[POISON], seed=1))
    s = out[0].samples[0]
    assert s.finish_reason == "error" and "OverflowError" in s.error and len(s.token_ids) == 2
    eng.check()
    good = innocents()[:2]
    assert [[s.token_ids for s in it.samples] for it in eng.generate(
        input_ids=[p for p, _ in good], sampling_params=[s for _, s in good])] == reference(llama_path, good)


class PoisonDetokenizer(Detokenizer):
    """The real detokenizer, except that a request with the stop string "\\0fail@k" raises on
    its k-th push."""

    def __init__(self, tokenizer, stop, *args):
        super().__init__(tokenizer, stop, *args)
        self.fail_at = next((int(s[6:]) for s in stop if s.startswith("\0fail@")), None)
        self.pushes = 0

    def push(self, token_ids):
        self.pushes += 1
        if self.pushes == self.fail_at:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned token")
        return super().push(token_ids)


def test_fanin_fault_costs_only_its_request(llama_path, monkeypatch, caplog):
    caplog.set_level(logging.ERROR, "fanout.engine")
    monkeypatch.setattr(front, "Detokenizer", PoisonDetokenizer)
    good = innocents()
    want = reference(llama_path, good)
    # One fails mid-run (still holding KV) with text held back (a stop string could still
    # match), one on its last token (already finished "length").
    eng = engine(llama_path)
    sp = SamplingParams(max_new_tokens=1, temperature=0)
    first = eng.generate(input_ids=[ids(10, 7)], sampling_params=sp)[0].samples[0].text
    assert first
    mid = (ids(10, 7), sp.copy(max_new_tokens=8, ignore_eos=True, stop=["\0fail@2", first + "\1"]))
    last = (ids(10, 8), SamplingParams(max_new_tokens=3, ignore_eos=True, stop=["\0fail@3"], seed=2))
    got = run(eng, good[:2] + [mid] + good[2:5] + [last] + good[5:])
    for k, n in ((2, 2), (6, 3)):
        ev = final(got[(k, 0)])
        assert ev.finish_reason == "error" and len(ev.token_ids) == n
        assert ev.error.startswith("internal error in engine step: UnicodeDecodeError")
    assert got[(2, 0)][-1].text_delta == first  # held back until the failure released it
    assert sum("failed in fan-in" in r.getMessage() for r in caplog.records) == 2
    for i, samples in enumerate(want):
        k = i + (i >= 2) + (i >= 5)
        assert [final(got[(k, j)]).token_ids for j in range(len(samples))] == samples
    eng.check()
    assert eng.generate(input_ids=[good[0][0]], sampling_params=[good[0][1]])[0].samples[0].token_ids \
        == want[0][0]


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_fault_in_every_request_raises_engine_error(llama_path, monkeypatch, where):
    """A fault no request explains (a lost device, the whole model out of memory): step()
    raises EngineError, the step is undone, and the engine stays consistent: with the fault
    gone it carries on to the very tokens of a run that never failed."""
    good = innocents()
    want = reference(llama_path, good)
    eng = engine(llama_path)
    events = {}
    eng.add("job", [(i, None, p) for i, (p, _) in enumerate(good)], [s for _, s in good],
            sink=lambda ev: events.setdefault((ev.index, ev.sample), []).append(ev))
    for _ in range(4):
        eng.step()
    sched = eng.scheduler
    assert any(r.output_ids for r in sched.running)  # some decoding, some still to prefill
    assert any(r.extend_todo > 1 for r in [*sched.running, *sched.waiting])
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("device lost")

    monkeypatch.setattr(*((eng.runner, "forward") if where == "forward" else (eng.executor, "sampler")),
                        broken)
    with pytest.raises(EngineError, match="device lost"):
        eng.step()
    assert len(calls) > 2  # bisected, then probed
    eng.check()
    assert not any(ev.finished for evs in events.values() for ev in evs)
    monkeypatch.undo()
    while eng.has_work():
        eng.step()
        eng.check()
    for i, samples in enumerate(want):
        assert [final(events[(i, j)]).token_ids for j in range(len(samples))] == samples


def test_bookkeeping_fault_raises_engine_error(llama_path, monkeypatch):
    """Outside the parts that can blame a request (here: building the batch), step() raises
    EngineError too, the only exception it raises, with the cause chained."""
    eng = engine(llama_path)
    eng.add("job", [(0, None, ids(5, 0))], SamplingParams(max_new_tokens=2))

    def schedule():
        raise IndexError("bad row")

    monkeypatch.setattr(eng.scheduler, "schedule", schedule)
    with pytest.raises(EngineError, match="IndexError: bad row") as err:
        eng.step()
    assert isinstance(err.value.__cause__, IndexError)
