import math
import random

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from worker.engine.req import Req
from worker.engine.sampler import Sampler, seeded_uniform
from worker.engine.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def req(seed=0, input_ids=(1, 2), output_ids=(), eos=(), **params):
    return Req(rid=f"r{seed}", input_ids=list(input_ids), params=SamplingParams(**params),
               seed=seed, eos_ids=frozenset(eos), output_ids=list(output_ids))


def logits_for(rows, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


# --- the hash ---------------------------------------------------------------------------

def _py_mix32(x):
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _py_uniform(seed, step, col):
    """Plain-integer reference of the sampler's hash (Python ints never overflow)."""
    m = 0xFFFFFFFF
    k = _py_mix32(((seed & m) + 0x9E3779B9) & m)
    k = _py_mix32(k ^ ((seed >> 32) & m))
    k = _py_mix32(k ^ (step & m))
    c = _py_mix32(col + 0x85EBCA6B)
    h = _py_mix32(_py_mix32(k ^ c) + k & m)
    return ((h >> 9) + 0.5) / (1 << 23)


@pytest.mark.parametrize("device", DEVICES)
def test_uniform_matches_integer_reference(device):
    seeds = [0, 1, 2**32 - 1, 2**32 + 5, 2**63 + 12345, 2**64 - 1]
    steps = [0, 7, 1, 2**31, 3, 100000]
    u = seeded_uniform(seeds, steps, 1000, device).cpu()
    for r, (s, t) in enumerate(zip(seeds, steps)):
        for c in (0, 1, 2, 511, 999):
            assert u[r, c].item() == _py_uniform(s, t, c)
    assert (u > 0).all() and (u < 1).all()


def test_uniform_looks_uniform_and_independent():
    u = seeded_uniform(list(range(64)), [3] * 64, 4096)
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    # Neighbouring seeds, steps and columns are uncorrelated.
    v = seeded_uniform(list(range(64)), [4] * 64, 4096)
    for a, b in [(u[:-1], u[1:]), (u, v), (u[:, :-1], u[:, 1:])]:
        corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
        assert abs(corr) < 0.01


# --- greedy and filters ------------------------------------------------------------------

def test_greedy_is_argmax():
    logits = logits_for(6, 50)
    s = Sampler(50, "cpu")
    out = s(logits, [req(seed=i, temperature=0.0) for i in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


@pytest.mark.parametrize("c_kernel", [True, False])
def test_greedy_picks_what_torch_max_picks(c_kernel, monkeypatch):
    """The greedy pick in C on a CPU (cpu_pointwise.argmax) or torch's max: the first of equal
    maxima, a NaN counted as the largest (torch.max's rule), all -inf -> 0, padding columns
    skipped through the rows' stride; one row and many, on every thread."""
    from worker.engine.kernels import cpu_pointwise
    from worker.engine.sampler import row_argmax
    if c_kernel and not cpu_pointwise.load():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    if not c_kernel:
        monkeypatch.setattr(cpu_pointwise, "load", lambda: False)
    g = torch.Generator().manual_seed(0)
    V = 49157  # not a whole number of vectors: the tail is scanned too
    x = torch.randn(12, V + 3, generator=g)
    x[:, V:] = 1e9  # padding: never picked
    x[1, [7, 900, V - 1]] = 50.0  # ties: the first
    x[2, V - 1] = 50.0  # in the tail
    x[3, :V] = -math.inf
    x[4, [10, 20]] = math.nan
    x[5, 5] = 50.0
    x[5, 300] = math.nan  # a NaN beats a larger number before it
    x[6, 0], x[6, 1] = -0.0, 0.0  # equal: the first
    x[6, 2:V] = -1.0
    # A NaN after a larger number still wins; of two NaNs, the first; a last-columns maximum.
    x[7, 10], x[7, V - 5] = 50.0, math.nan
    x[8, [20, V - 20]] = math.nan
    x[9, V - 30] = 50.0  # the largest in the last part only
    rows = x[:, :V]
    want = rows.max(dim=-1).indices
    assert want[:10].tolist() == [want[0].item(), 7, V - 1, 0, 10, 300, 0, V - 5, 20, V - 30]
    assert torch.equal(row_argmax(rows), want)
    for i in range(10):  # each row alone (on one thread)
        assert torch.equal(row_argmax(rows[i:i + 1]), want[i:i + 1]), i
    wide = torch.randn(64, V, generator=g)  # 3M floats: both threads
    assert torch.equal(row_argmax(wide), wide.max(dim=-1).indices)
    s = Sampler(V, "cpu")
    assert s(x, [req(seed=i, temperature=0.0) for i in range(12)]).token_ids == want.tolist()


def test_whole_vocabulary_draw_in_c_is_the_torch_ops_draw(monkeypatch):
    """A row drawn over the whole vocabulary (no top-k / top-p) on a CPU: in C in one pass that
    scores only the values its bounds cannot rule out (cpu_noise.gumbel_argmax), or by torch
    ops over every value (argmax of z - log(-log u)). The same tokens for peaked rows (few
    values scored), flat ones (most), ties (rounded logits: the first), a vocabulary that is
    not a whole number of lanes or blocks, NaN (the first), +inf (the first) and rows of -inf
    (0); one row and many. The logs differ in the last bit at most, which these rows never
    meet at their winner."""
    from worker.engine.kernels import cpu_noise
    if not cpu_noise.load():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    g = torch.Generator().manual_seed(5)
    V = 49157
    spread = torch.tensor([0.3, 1.0, 3.0, 8.0, 20.0, 60.0] * 8)[:, None]
    x = torch.randn(48, V, generator=g) * spread
    x[40:43] = x[40:43].round()  # many equal logits
    x[43] = 0.0
    x[43, [5000, 30000]] = 2.0**30  # the noise is under half an ulp there: two equal scores, the first wins
    x[44, :V - 1] = -math.inf  # the last column only
    x[45, :] = -math.inf
    x[46, [3, 40000]] = math.nan
    x[47, [17, V - 2]] = math.inf
    reqs = [req(seed=i * 7919, output_ids=[0] * (i % 5), temperature=0.9) for i in range(48)]
    s = Sampler(V, "cpu")
    c = s(x.clone(), reqs).token_ids
    alone = [s(x[i:i + 1].clone(), reqs[i:i + 1]).token_ids[0] for i in range(48)]
    monkeypatch.setattr(cpu_noise, "load", lambda: False)
    torch_ops = s(x.clone(), reqs).token_ids
    assert c == torch_ops == alone
    assert c[43:] == [5000, V - 1, 0, 3, 17]


def test_an_unfiltered_row_is_drawn_the_same_way_beside_filtered_ones(monkeypatch):
    """On a CPU an unfiltered row is drawn in C (its own log) whatever its batch-mates: beside
    a min-p row or a top-p row the whole vocabulary must decide, which take torch's ops, it
    still goes to C, alone, so its token cannot depend on the batch it runs in."""
    from worker.engine.kernels import cpu_noise
    if not cpu_noise.load():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    drawn = []
    real = cpu_noise.gumbel_argmax

    def spy(z, row_keys, col_keys):
        drawn.append(z.shape[0])
        return real(z, row_keys, col_keys)
    monkeypatch.setattr(cpu_noise, "gumbel_argmax", spy)
    V = 3000
    s = Sampler(V, "cpu")
    x = logits_for(3, V, seed=8) * 0.2  # flat: a top-p set past every candidate count
    plain = req(seed=11, temperature=0.9)
    alone = s(x[:1].clone(), [plain]).token_ids[0]
    mates = [req(seed=12, temperature=0.9, min_p=0.05), req(seed=13, temperature=0.9, top_p=0.999)]
    assert s(x.clone(), [plain] + mates).token_ids[0] == alone
    assert drawn == [1, 1]


def test_a_sampled_call_leaves_the_callers_logits_alone():
    """Without penalties no copy is made of the logits for them: the draw (temperature,
    top-k, top-p, min-p) must not write into the caller's rows."""
    V = 2000
    x = logits_for(4, V, seed=6)
    before = x.clone()
    reqs = [req(seed=1, temperature=0.8), req(seed=2, temperature=1.1, top_p=0.9),
            req(seed=3, temperature=0.7, top_k=20), req(seed=4, temperature=0.5, min_p=0.1)]
    Sampler(V, "cpu")(x, reqs)
    assert torch.equal(x, before)


def test_top_k_in_c_is_the_torch_ops_order():
    """A row's k largest values and their columns (the candidates of a top-k / top-p draw), in
    C on a CPU (cpu_pointwise.top_k): a stable descending sort's first k, values and columns
    (larger first, ties by column; torch's topk may take any of the values tied at the k-th,
    which the sampler then leaves to the whole vocabulary), for ties across that edge, rows
    whose largest come last (the buffer refilled often), k near N, softmax rows as the
    sampler gives them, and one row or many."""
    from worker.engine.kernels import cpu_pointwise
    from worker.engine.sampler import top_k
    if not cpu_pointwise.load():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    g = torch.Generator().manual_seed(9)
    V = 49157
    x = torch.randn(10, V, generator=g)
    x[1] = x[1].round()  # a few distinct values: ties everywhere, across the edge too
    x[2] = torch.arange(V, dtype=torch.float32)  # ascending: every value joins, then is pushed out
    x[3, :] = 0.0
    x[3, [5, 70, V - 1]] = 1.0
    x[4] = torch.softmax(x[4] * 4, -1)
    x[5, ::3] = -math.inf
    for k in (1, 7, 256, 4096, V - 1):
        want_v, want_i = (t[:, :k] for t in x.sort(dim=-1, descending=True, stable=True))
        vals, ids = top_k(x, k)
        assert torch.equal(ids, want_i) and torch.equal(vals, want_v), k
        for r in (1, 3):  # one row (one thread)
            assert torch.equal(top_k(x[r:r + 1], k)[1], want_i[r:r + 1]), (k, r)
    assert top_k(x[3:4], 2)[1].tolist() == [[5, 70]]
    nan = x[:2].clone()
    nan[0, 9] = math.nan
    vals, ids = top_k(nan, 4)
    assert vals[0].isnan().all() and ids[0].tolist() == [0, 1, 2, 3]
    assert torch.equal(ids[1], top_k(x[1:2], 4)[1][0])
    with pytest.raises(ValueError, match="top_k"):
        cpu_pointwise.top_k(x, V)


def test_top_k_1_is_greedy_whatever_the_temperature():
    logits = logits_for(8, 50)
    s = Sampler(50, "cpu")
    out = s(logits, [req(seed=i, temperature=5.0, top_k=1) for i in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_padding_columns_are_never_sampled():
    logits = torch.zeros(4, 12)
    logits[:, 10:] = 100.0  # lm_head padding past the real vocab
    s = Sampler(10, "cpu")
    assert all(t < 10 for t in s(logits, [req(seed=i, temperature=0.0) for i in range(4)]).token_ids)
    assert all(t < 10 for t in s(logits, [req(seed=i) for i in range(4)]).token_ids)


def _allowed(logits_row, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """The set of tokens the filters let through, computed one row at a time."""
    p = torch.softmax(logits_row / temperature, -1).tolist()
    order = sorted(range(len(p)), key=lambda i: -p[i])
    if top_k > 0:
        order = order[:top_k]
    total = sum(p[i] for i in order)
    kept, mass = [], 0.0
    for i in order:
        if top_p < 1.0 and mass >= top_p:
            break
        kept.append(i)
        mass += p[i] / total
    pmax = max(p)
    return {i for i in kept if p[i] >= min_p * pmax}


@pytest.mark.parametrize("flt", [
    dict(top_k=5), dict(top_p=0.5), dict(min_p=0.2), dict(top_k=8, top_p=0.7, temperature=0.6),
    dict(top_p=0.9, min_p=0.05, temperature=1.5),
])
def test_samples_stay_inside_the_allowed_set(flt):
    V, n = 40, 300
    base = logits_for(1, V, seed=1)[0] / 3
    allowed = _allowed(base, **flt)
    assert 1 < len(allowed) < V
    s = Sampler(V, "cpu")
    toks = s(base.expand(n, V).clone(), [req(seed=i, **flt) for i in range(n)]).token_ids
    assert set(toks) <= allowed
    assert len(set(toks)) > 1  # the filters cut the tail, they do not make it greedy


def test_mixed_rows_each_get_their_own_filters():
    V = 40
    base = logits_for(1, V, seed=2)[0]
    rows = [dict(temperature=0.0), dict(top_k=3), dict(top_p=0.3), dict(min_p=0.5), dict()]
    reqs = [req(seed=i, **rows[i % len(rows)]) for i in range(200)]
    toks = Sampler(V, "cpu")(base.expand(200, V).clone(), reqs).token_ids
    for i, t in enumerate(toks):
        f = rows[i % len(rows)]
        if f.get("temperature") == 0.0:
            assert t == base.argmax().item()
        else:
            assert t in _allowed(base, **f)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_distribution_matches_softmax(temperature):
    V, n = 8, 8000
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    reqs = [req(seed=i, temperature=temperature) for i in range(n)]
    toks = Sampler(V, "cpu")(base.expand(n, V).clone(), reqs).token_ids
    counts = torch.bincount(torch.tensor(toks), minlength=V).double()
    expected = torch.softmax(base.double() / temperature, -1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 24.3  # chi-square, 7 degrees of freedom, p = 0.001


# --- reproducibility -----------------------------------------------------------------------

def test_same_seed_and_step_give_the_same_token_in_any_batch():
    V = 64
    s = Sampler(V, "cpu")
    target = req(seed=1234, output_ids=[5, 6, 7], top_p=0.9, temperature=0.8)
    row = logits_for(1, V, seed=3)
    alone = s(row.clone(), [target]).token_ids[0]

    rng = random.Random(0)
    for trial in range(5):
        others = [req(seed=rng.randrange(2**40), output_ids=[1] * rng.randrange(5),
                      temperature=rng.choice([0.0, 0.5, 1.0, 1.3]), top_k=rng.choice([-1, 4, 20]),
                      top_p=rng.choice([1.0, 0.8]), min_p=rng.choice([0.0, 0.1]),
                      repetition_penalty=rng.choice([1.0, 1.2]))
                  for _ in range(50)]
        pos = rng.randrange(51)
        reqs = others[:pos] + [target] + others[pos:]
        batch = logits_for(51, V, seed=100 + trial)
        batch[pos] = row[0]
        assert s(batch, reqs).token_ids[pos] == alone


def test_different_seeds_and_steps_give_different_samples():
    V = 1000
    s = Sampler(V, "cpu")
    flat = torch.zeros(20, V)
    by_seed = s(flat.clone(), [req(seed=i) for i in range(20)]).token_ids
    assert len(set(by_seed)) >= 18
    by_step = s(flat.clone(), [req(seed=7, output_ids=[0] * i) for i in range(20)]).token_ids
    assert len(set(by_step)) >= 18
    again = s(flat.clone(), [req(seed=i) for i in range(20)]).token_ids
    assert again == by_seed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_sample_the_same_tokens():
    V = 5000
    logits = logits_for(64, V, seed=4)
    reqs = [req(seed=i, output_ids=[i % 7] * (i % 5), top_p=0.95, top_k=50 if i % 2 else -1,
                temperature=0.9, repetition_penalty=1.1 if i % 3 == 0 else 1.0) for i in range(64)]
    cpu = Sampler(V, "cpu")(logits, reqs).token_ids
    gpu = Sampler(V, "cuda")(logits.cuda(), reqs).token_ids
    assert cpu == gpu


# --- penalties, min_new_tokens, logprobs ----------------------------------------------------

def test_repetition_penalty_matches_transformers():
    V = 30
    logits = logits_for(2, V, seed=5)
    reqs = [req(input_ids=[1, 2, 3, 3], output_ids=[7, 9], repetition_penalty=1.3, temperature=0.0),
            req(input_ids=[4], output_ids=[], repetition_penalty=0.8, temperature=0.0)]
    got = Sampler(V, "cpu").apply_penalties(logits, reqs)
    for i, r in enumerate(reqs):
        proc = RepetitionPenaltyLogitsProcessor(penalty=r.params.repetition_penalty)
        want = proc(torch.tensor([r.input_ids + r.output_ids]), logits[i:i + 1].clone())[0]
        torch.testing.assert_close(got[i], want)


def test_frequency_and_presence_penalties():
    V = 20
    logits = logits_for(3, V, seed=6)
    outs = [[3, 3, 3, 5], [], [0, 19, 19]]
    reqs = [req(input_ids=[5, 6], output_ids=outs[0], frequency_penalty=0.5, presence_penalty=1.0),
            req(output_ids=outs[1], frequency_penalty=1.0),
            req(input_ids=[0], output_ids=outs[2], frequency_penalty=-0.3, presence_penalty=0.2)]
    got = Sampler(V, "cpu").apply_penalties(logits, reqs)
    want = logits.clone()
    for i, r in enumerate(reqs):
        for t in set(outs[i]):  # prompt tokens do not count
            c = outs[i].count(t)
            want[i, t] -= c * r.params.frequency_penalty + r.params.presence_penalty
    torch.testing.assert_close(got, want)
    assert not torch.equal(got, logits)


def test_penalties_leave_the_input_alone_and_steer_greedy():
    V = 10
    logits = torch.zeros(1, V)
    logits[0, 4] = 1.0
    logits[0, 2] = 0.9
    before = logits.clone()
    s = Sampler(V, "cpu")
    assert s(logits, [req(temperature=0.0)]).token_ids == [4]
    assert s(logits, [req(output_ids=[4], temperature=0.0, presence_penalty=0.5)]).token_ids == [2]
    assert s(logits, [req(input_ids=[4], temperature=0.0, repetition_penalty=2.0)]).token_ids == [2]
    assert torch.equal(logits, before)


def test_min_new_tokens_masks_eos_and_stop_tokens():
    V = 10
    logits = torch.zeros(3, V)
    logits[:, 9] = 10.0  # eos
    logits[:, 8] = 9.0  # a stop token id
    logits[:, 3] = 8.0
    s = Sampler(V, "cpu")
    p = dict(min_new_tokens=2, stop_token_ids=[8], eos=[9], temperature=0.0)
    out = s(logits, [req(output_ids=[], **p), req(output_ids=[1], **p), req(output_ids=[1, 1], **p)])
    assert out.token_ids == [3, 3, 9]
    sampled = s(logits[:1].expand(50, V).clone(), [req(seed=i, min_new_tokens=1, stop_token_ids=[8], eos=[9])
                                                  for i in range(50)]).token_ids
    assert 8 not in sampled and 9 not in sampled


def test_logprobs_are_log_softmax_of_raw_logits():
    """Before penalties and temperature; top tokens only where asked, k of them, best first."""
    V = 30
    logits = logits_for(5, V, seed=7)
    reqs = [req(seed=0, temperature=0.0, logprobs=True, top_logprobs=5), req(seed=1, temperature=0.5),
            req(seed=2, output_ids=[1, 1], repetition_penalty=1.5, top_k=3, logprobs=True),
            req(seed=3, temperature=2.0, logprobs=True, top_logprobs=20),
            req(seed=4, temperature=0.0, logprobs=True, top_logprobs=1)]
    out = Sampler(V, "cpu")(logits, reqs)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    for i in (0, 2, 3, 4):
        t, lp, k = out.token_ids[i], out.logprobs[i], reqs[i].params.top_logprobs
        assert math.isclose(lp.logprob, ref[i, t].item(), rel_tol=1e-6, abs_tol=1e-6)
        want = ref[i].sort(descending=True)
        assert [tok for tok, _ in lp.top] == want.indices[:k].tolist()
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), want.values[:k], rtol=1e-6, atol=1e-6)
    assert out.logprobs[0].top[0][0] == out.token_ids[0]  # greedy: the best of the raw logits
    assert Sampler(V, "cpu")(logits, [req(seed=1, temperature=0.5)] * 5).logprobs is None


def test_bad_logits_shape_is_named():
    with pytest.raises(ValueError, match="logits"):
        Sampler(10, "cpu")(torch.zeros(2, 10), [req()])
    with pytest.raises(ValueError, match="logits"):
        Sampler(10, "cpu")(torch.zeros(1, 8), [req()])


@pytest.mark.parametrize("c_kernel", [True, False])
def test_uniform_at_columns_is_the_whole_rows_value(c_kernel, monkeypatch):
    """seeded_uniform_at hashes in int64, seeded_uniform in C on a CPU (kernels/cpu_noise.c)
    or in int32 lanes of torch ops in blocks of columns (CUDA, or no compiler): every value
    equal, at a real vocabulary's width and over several blocks."""
    from worker.engine.kernels import cpu_noise
    from worker.engine.sampler import _col_keys, seeded_uniform_at
    if c_kernel and not cpu_noise.load():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    if not c_kernel:
        monkeypatch.setattr(cpu_noise, "load", lambda: False)
    V = 49152
    seeds = [7, 2**40 + 3, 0, 2**64 - 1] + [(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(60)]
    steps = [0, 11, 99, 2**31 + 1] + list(range(60))
    whole = seeded_uniform(seeds, steps, V)
    cols = torch.arange(V).expand(len(seeds), V)
    assert torch.equal(seeded_uniform_at(seeds, steps, cols, _col_keys(V, "cpu")), whole)
    if c_kernel:  # a column outside the vocabulary is named, not read past the keys
        with pytest.raises(IndexError, match=f"column {V} outside"):
            cpu_noise.uniform_at(torch.zeros(1, dtype=torch.int64), torch.tensor([[3, V]]), _col_keys(V, "cpu"))


@pytest.mark.parametrize("c_kernel", [True, False])
def test_filtered_rows_decided_among_candidates_draw_what_the_whole_vocabulary_gives(c_kernel, monkeypatch):
    """The fast path (top-k / top-p decided among the CANDIDATES most likely tokens, picked in
    C on a CPU or by torch's topk) draws exactly the tokens of the whole-vocabulary path, for
    peaked rows (decided there) and flat ones (left to the whole vocabulary), ties at the
    edge included."""
    from worker.engine.kernels import cpu_pointwise
    if c_kernel and not cpu_pointwise.load():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    if not c_kernel:
        monkeypatch.setattr(cpu_pointwise, "load", lambda: False)
    V = 2000
    s = Sampler(V, "cpu")
    g = torch.Generator().manual_seed(0)
    rng = random.Random(1)
    logits = torch.randn(300, V, generator=g) * torch.tensor([rng.choice([0.5, 3.0, 8.0]) for _ in range(300)])[:, None]
    logits[::7, 100:400] = logits[::7, 100:101]  # ties, some across the candidates' edge
    reqs = [req(seed=rng.randrange(2**40), output_ids=[1] * rng.randrange(4), temperature=rng.choice([0.5, 1.0, 1.4]),
                top_k=rng.choice([-1, 5, 40, 200, 1000]), top_p=rng.choice([1.0, 0.95, 0.8, 0.3]),
                min_p=rng.choice([0.0, 0.05])) for _ in range(300)]
    got = s(logits.clone(), reqs).token_ids
    ps = [r.params for r in reqs]
    z = logits / torch.tensor([p.temperature for p in ps])[:, None]
    want = s._over_vocab(z.clone(), ps, [r.seed for r in reqs], [len(r.output_ids) for r in reqs]).tolist()
    assert got == want
    filtered = [j for j, p in enumerate(ps) if 0 < p.top_k < V or p.top_p < 1.0]
    _, decided = s._among_candidates(z.clone(), filtered, ps, [r.seed for r in reqs],
                                     [len(r.output_ids) for r in reqs], 256)
    assert 0 < len(decided) < len(filtered)  # both paths ran
