"""The decode graph runner: its bucketing and padding, checked on a CPU through its uncaptured
path (same static buffers and padding, run eagerly); the engine with the Triton backend
(interpreter) against the torch backend; and on a CPU its recorded forwards (C kernel calls
replayed in one call, kernels/cpu_graph.py) against the eager forward."""
import logging

import pytest
import torch

from worker.engine import Engine, SamplingParams
from worker.engine.batch import ForwardBatch, ForwardMode
from worker.engine.cuda_graph import FIELDS, CudaGraphRunner, batch_sizes, cpu_batch_sizes, pick_size
from worker.engine.kernels import cpu_graph, cpu_linear
from worker.engine.kv_pool import KVPool


def test_batch_sizes_default_and_given():
    assert batch_sizes(None, None, 256) == [1, 2, 4] + list(range(8, 257, 8))
    assert batch_sizes(None, None, 20) == [1, 2, 4, 8, 16, 20]
    assert batch_sizes(12, None, 256) == [1, 2, 4, 8, 12]
    assert batch_sizes(None, None, 1) == [1]
    assert batch_sizes(None, [8, 1, 8, 3], 16) == [1, 3, 8]
    assert batch_sizes(8, [2, 8], 16) == [2, 8]


@pytest.mark.parametrize("max_bs,sizes,match", [
    (0, None, "cuda_graph_max_bs"), (32, None, "cuda_graph_max_bs: 32 exceeds max_running"),
    (None, [0, 2], "cuda_graph_batch_sizes"), (None, [], "cuda_graph_batch_sizes"),
    (4, [2, 8], "exceeds cuda_graph_max_bs"), (None, [2, 17], "exceeds max_running"),
])
def test_batch_sizes_bad(max_bs, sizes, match):
    with pytest.raises(ValueError, match=match):
        batch_sizes(max_bs, sizes, 16)


def test_engine_rejects_bad_graph_options(llama_path):
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        Engine(llama_path, max_running=8, cuda_graph_max_bs=9)


def test_pick_size():
    sizes = [1, 2, 4, 8]
    assert [pick_size(sizes, n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]


def test_scratch_row_never_handed_out(llama_path):
    eng = Engine(llama_path, max_running=3)
    runner = eng.runner
    pool = runner.req_to_token
    rows = [pool.alloc() for _ in range(3)]
    assert pool.alloc() is None and pool.scratch_row not in rows
    assert not runner.req_to_token.table[pool.scratch_row].any()


def test_sizing_warmup_forward(llama_path):
    """The start-up warm-up (run on a GPU before sizing the KV pool) on a temporary pool:
    capped at what one step can hold (2 rows x 1024 tokens here), rows given back clean."""
    eng = Engine(llama_path, max_running=2, page_size=16)
    runner, c = eng.runner, eng.runner.config
    kv = KVPool(c.num_layers, 2500 // 16 + 2, 16, c.num_kv_heads, c.head_dim, runner.dtype, "cpu")
    runner._warmup(kv, runner.req_to_token, 2500)
    assert runner.req_to_token.num_free == 2 and not runner.req_to_token.table.any()
    written = kv.k[1].abs().sum((1, 2)) > 0
    assert written[16:16 + 2048].all() and not written[:16].any() and not written[16 + 2048:].any()


def _decode_batch(eng, seq_lens, gen):
    """A decode batch over requests with random cached KV of the given lengths."""
    runner, kv = eng.runner, eng.runner.kv
    ps, table = kv.page_size, runner.req_to_token.table
    rows = [runner.req_to_token.alloc() for _ in seq_lens]
    for row, n in zip(rows, seq_lens):
        pages = torch.tensor(kv.allocator.alloc(-(-n // ps)))
        table[row, :n] = (pages[:, None] * ps + torch.arange(ps)).flatten()[:n]
    for layer in range(len(kv.k)):
        kv.k[layer].copy_(torch.randn(kv.k[layer].shape, generator=gen))
        kv.v[layer].copy_(torch.randn(kv.v[layer].shape, generator=gen))
    B = len(seq_lens)
    lens = torch.tensor(seq_lens)
    rows_t = torch.tensor(rows)
    return ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.randint(3, 500, (B,), generator=gen),
        positions=lens - 1, out_cache_loc=table[rows_t, lens - 1], req_pool_indices=rows_t,
        seq_lens=lens, prefix_lens=lens - 1, extend_lens=torch.ones(B, dtype=torch.int64),
        extend_start_loc=torch.arange(B), seq_lens_cpu=list(seq_lens),
        prefix_lens_cpu=[n - 1 for n in seq_lens], extend_lens_cpu=[1] * B,
        req_to_token=table, kv=kv, logits_idx=torch.arange(B))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_run_equals_eager(llama_path, backend):
    eng = Engine(llama_path, page_size=4, kv_tokens=256, attention_backend=backend)
    runner, kv = eng.runner, eng.runner.kv
    fb = _decode_batch(eng, [5, 17, 30], torch.Generator().manual_seed(0))
    before = [t.clone() for t in kv.k + kv.v]
    ref = runner.forward_eager(fb)
    after_ref = [t.clone() for t in kv.k + kv.v]
    for t, b in zip(kv.k + kv.v, before):
        t.copy_(b)

    graphs = CudaGraphRunner(runner, [1, 2, 4, 8], capture=False)
    runner.graphs = graphs
    # Stale values from a bigger batch must not leak into the padding.
    graphs.buf.fill_(7)
    out = runner.forward(fb)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # Padded to 4: row 3 is padding; rows 0..2 are the batch's inputs.
    for i, name in enumerate(FIELDS):
        assert torch.equal(graphs.buf[i, :3], getattr(fb, name)), name
    assert graphs.buf[:, 3].tolist() == [0, 0, 0, runner.req_to_token.scratch_row, 1, 0]
    assert graphs.batches[4].seq_lens_cpu == [5, 17, 30, 1]
    # The padded row wrote only the scratch slot 0; every other slot is as in the eager run
    # (up to rounding: the projections ran with 4 rows instead of 3).
    written = {0, *fb.out_cache_loc.tolist()}
    for t, r, b in zip(kv.k + kv.v, after_ref, before):
        assert set((t != b).flatten(1).any(1).nonzero().flatten().tolist()) == written
        torch.testing.assert_close(t[1:], r[1:], atol=1e-4, rtol=1e-4)
    assert not runner.req_to_token.table[runner.req_to_token.scratch_row].any()

    # A 1-token chunk of a longer prompt wants no logits: only the rows asked for come back.
    fb.logits_idx = torch.tensor([0, 2])
    torch.testing.assert_close(runner.forward(fb), ref[[0, 2]], atol=1e-4, rtol=1e-4)
    # Too big for the largest size, or an extend batch: eager.
    assert graphs.can_run(fb)
    fb.mode = ForwardMode.EXTEND
    assert not graphs.can_run(fb)


def _greedy(eng, batch, max_new):
    sps = [SamplingParams(max_new_tokens=m, min_new_tokens=m, temperature=0) for m in max_new]
    return [it.samples[0].token_ids for it in eng.generate(input_ids=batch, sampling_params=sps)]


def test_engine_triton_equals_torch_with_and_without_padding(llama_path):
    # Mixed lengths and outputs: the decode batch shrinks 3 -> 2 -> 1 and pads to 4 and 2.
    batch = [[5, 9, 11, 40, 7], list(range(20, 57)), [3, 4] * 9]
    max_new = [6, 4, 2]
    ref = _greedy(Engine(llama_path, page_size=4), batch, max_new)
    eng = Engine(llama_path, page_size=4, attention_backend="triton")
    assert _greedy(eng, batch, max_new) == ref
    eng.runner.graphs = CudaGraphRunner(eng.runner, [2, 4], capture=False)
    assert _greedy(eng, batch, max_new) == ref
    eng.check()


def test_cpu_batch_sizes():
    assert cpu_batch_sizes(None, None, 256) == list(range(1, 17))
    assert cpu_batch_sizes(None, None, 5) == [1, 2, 3, 4, 5]
    assert cpu_batch_sizes(3, None, 256) == [1, 2, 3]
    assert cpu_batch_sizes(None, [4, 2], 8) == [2, 4]
    with pytest.raises(ValueError, match="cuda_graph_max_bs: 32 exceeds max_running"):
        cpu_batch_sizes(32, None, 16)


def test_recording_refuses_torch_ops_and_host_reads():
    t = torch.ones(4)
    with pytest.raises(cpu_graph.NotRecordable, match="aten.add"):
        cpu_graph.record(lambda: t + 1)
    with pytest.raises(cpu_graph.NotRecordable, match="_local_scalar_dense"):
        cpu_graph.record(lambda: t[0].item())


def test_a_recorded_matmul_replays_on_its_inputs_new_values():
    assert cpu_linear.load()
    gen = torch.Generator().manual_seed(0)
    panels, x = cpu_linear.pack(torch.randn(40, 24, generator=gen)), torch.randn(3, 24, generator=gen)
    arena = cpu_graph.Arena(1 << 16)
    rec = cpu_graph.record(lambda: cpu_linear.linear(x, panels), arena)
    start = arena.buf.data_ptr()
    assert not rec.kept and start <= rec.out.data_ptr() < start + arena.buf.numel()
    assert rec.used == 3 * 40 * 4 + 32  # its one allocation, rounded up to a cache line
    x.copy_(torch.randn(3, 24, generator=gen))
    rec.replay()
    assert torch.equal(rec.out, cpu_linear.linear(x, panels))
    # An arena too small for an allocation: it comes from torch instead, kept with the recording.
    small = cpu_graph.record(lambda: cpu_linear.linear(x, panels), cpu_graph.Arena(64))
    assert len(small.kept) == 1 and small.kept[0].data_ptr() == small.out.data_ptr() and small.nbytes == 480


def test_a_recording_takes_only_its_own_threads_kernel_calls():
    """Another thread's kernels (another engine's) running meanwhile are not recorded."""
    import threading
    assert cpu_linear.load()
    panels, x = cpu_linear.pack(torch.randn(40, 24)), torch.randn(3, 24)
    other, stop = [0], threading.Event()

    def elsewhere():
        y = torch.randn(2, 24)
        while not stop.is_set():
            cpu_linear.linear(y, panels)
            other[0] += 1

    t = threading.Thread(target=elsewhere)
    t.start()
    try:
        while other[0] == 0:
            pass
        before = other[0]
        rec = cpu_graph.record(lambda: [cpu_linear.linear(x, panels) for _ in range(200)][-1])
        during = other[0] - before
    finally:
        stop.set()
        t.join()
    assert during > 0 and len(rec.calls) == 200
    assert all(c.i[0] == x.data_ptr() for c in rec.calls)  # each call's x: this thread's


def _restore(kv, saved):
    for t, s in zip(kv.k + kv.v, saved):
        t.copy_(s)


def test_recorded_decode_equals_eager(llama_path):
    """Each size recorded by its first batch, all in one arena; each batch's logits and K/V
    writes are the eager forward's, bit for bit (the same kernels on the same rows), recorded
    or replayed, whatever size ran before."""
    eng = Engine(llama_path, page_size=4, kv_tokens=512, max_running=24, cuda_graph_max_bs=8)
    runner, kv = eng.runner, eng.runner.kv
    graphs = runner.graphs
    assert graphs.sizes == list(range(1, 9)) and not graphs.recordings
    assert runner.mem["graphs"] == graphs.nbytes == graphs.arena.buf.numel() > 0
    gen = torch.Generator().manual_seed(0)
    batches = [_decode_batch(eng, lens, gen) for lens in ([5, 17, 30], [9], [3, 9, 2, 40, 11, 6, 7, 8])]
    saved = [t.clone() for t in kv.k + kv.v]
    refs = []
    for fb in batches:
        refs.append((runner.forward_eager(fb).clone(), [t.clone() for t in kv.k + kv.v]))
        _restore(kv, saved)
    for fb, (ref, ref_kv) in [*zip(batches, refs), (batches[0], refs[0])]:
        out = runner.forward(fb)
        assert out.data_ptr() == graphs.recordings[fb.batch_size][0].out.data_ptr()  # replayed
        assert torch.equal(out, ref)
        assert all(torch.equal(t, r) for t, r in zip(kv.k + kv.v, ref_kv))
        _restore(kv, saved)
    assert sorted(graphs.recordings) == [1, 3, 8] and graphs.nbytes == graphs.arena.buf.numel()
    # A batch bigger than every recording runs eagerly.
    assert not graphs.can_run(_decode_batch(eng, [4] * 9, gen))


def test_engine_replays_recorded_decode_steps(llama_path, monkeypatch):
    """Greedy outputs with recorded steps equal those without, the batch shrinking 3 -> 2 -> 1."""
    batch = [[5, 9, 11, 40, 7], list(range(20, 57)), [3, 4] * 9]
    max_new = [6, 4, 2]
    ref = _greedy(Engine(llama_path, page_size=4, cuda_graph=False), batch, max_new)
    eng = Engine(llama_path, page_size=4)
    replays = []
    replay = cpu_graph.Recording.replay
    monkeypatch.setattr(cpu_graph.Recording, "replay", lambda self: replays.append(1) or replay(self))
    assert _greedy(eng, batch, max_new) == ref
    # Decode steps of 3 rows, 3, 2, 2, 1 (the first token is prefill's): a size's first batch
    # is recorded as it runs, the others replay it.
    assert sorted(eng.runner.graphs.recordings) == [1, 2, 3] and len(replays) == 2


@pytest.mark.parametrize("arch,why", [("mixtral", "runs in torch"), ("gemma3", "has no body")])
def test_models_that_cannot_be_recorded_run_eagerly(tiny_models, arch, why, caplog):
    with caplog.at_level(logging.INFO, logger="fanout.engine"):
        eng = Engine(tiny_models[arch], page_size=4)
    assert eng.runner.graphs is None
    assert any("CPU graphs off" in r.message and why in r.message for r in caplog.records)
