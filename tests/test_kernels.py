"""Triton kernels (in the interpreter on a CPU) against their torch references, the Triton
attention backend against the torch backend, and the CPU decode kernel (C) against the torch
path. Shapes stay tiny: the interpreter is slow."""
import logging
import math
import os
import shutil

import pytest
import torch

from worker.engine.attention.torch_backend import TorchBackend
from worker.engine.attention.triton_backend import TritonBackend
from worker.engine.batch import ForwardBatch, ForwardMode
from worker.engine.kernels import cpu_build, cpu_linear
from worker.engine.kernels.decode_attention import decode_attention, decode_attention_ref
from worker.engine.kernels.extend_attention import extend_attention, extend_attention_ref
from worker.engine.kernels.store_kv import store_kv, store_kv_ref
from worker.engine.kv_pool import KVPool, ReqToTokenPool

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=1e-2)}
SLOTS = 512  # per pool, whatever the page size
MAX_CTX = 128


def _table(seq_lens, page_size, gen):
    """req_to_token for requests of the given lengths, in shuffled rows, on shuffled pages
    (never page 0). Returns (table [R, MAX_CTX], req_pool_indices [B])."""
    pages = (torch.randperm(SLOTS // page_size - 1, generator=gen) + 1).tolist()
    rows = torch.randperm(len(seq_lens) + 2, generator=gen)[:len(seq_lens)]
    table = torch.zeros(len(seq_lens) + 2, MAX_CTX, dtype=torch.int64)
    for row, n in zip(rows.tolist(), seq_lens):
        mine = torch.tensor([pages.pop() for _ in range(-(-n // page_size))], dtype=torch.int64)
        slots = (mine[:, None] * page_size + torch.arange(page_size)).flatten()
        table[row, :n] = slots[:n]
    return table, rows


def _buffers(page_size, hkv, d, dtype, gen):
    shape = (SLOTS, hkv, d)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv(page_size, dtype):
    gen = torch.Generator().manual_seed(0)
    kb, vb = _buffers(page_size, 2, 24, dtype, gen)
    table, rows = _table([5, 9], page_size, gen)
    loc = torch.cat([table[rows[0], 2:5], table[rows[1], :9]])
    # k and v as views of a fused projection (strided rows), in fp32 whatever the cache dtype.
    kv = torch.randn(len(loc), 2, 2, 24, generator=gen)
    k, v = kv[:, 0], kv[:, 1]
    kr, vr = kb.clone(), vb.clone()
    store_kv(k, v, kb, vb, loc)
    store_kv_ref(k, v, kr, vr, loc)
    assert torch.equal(kb, kr) and torch.equal(vb, vr)
    assert torch.equal(kb[loc], k.to(dtype))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 32), (3, 3, 16), (36, 2, 16)])
def test_decode_attention(page_size, dtype, hq, hkv, d):
    gen = torch.Generator().manual_seed(1)
    seq_lens = [1, 70, 33, 16]  # 70 spreads over 3 of the 4 splits; 1 leaves 3 empty
    kb, vb = _buffers(page_size, hkv, d, dtype, gen)
    table, rows = _table(seq_lens, page_size, gen)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens)
    out = decode_attention(q, kb, vb, table, rows, lens, 0.25, num_kv_splits=4)
    ref = decode_attention_ref(q, kb, vb, table, rows, lens, 0.25)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("prefix_lens", [[0, 0, 0], [13, 0, 40]])
def test_extend_attention(page_size, dtype, prefix_lens):
    gen = torch.Generator().manual_seed(2)
    extend_lens = [70, 1, 5]  # 70 spans several query blocks
    hq, hkv, d = 4, 2, 32
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    kb, vb = _buffers(page_size, hkv, d, dtype, gen)
    table, rows = _table(seq_lens, page_size, gen)
    q = torch.randn(sum(extend_lens), hq, d, generator=gen).to(dtype)
    ext = torch.tensor(extend_lens)
    start = torch.cumsum(ext, 0) - ext
    args = (q, kb, vb, table, rows, torch.tensor(seq_lens), start, ext)
    out = extend_attention(*args, max(extend_lens), 0.2)
    ref = extend_attention_ref(*args, 0.2)
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_bad_input_names_the_field():
    q = torch.randn(2, 3, 16)
    kb = torch.randn(8, 2, 16)
    table = torch.zeros(2, 8, dtype=torch.int64)
    two = torch.ones(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention(q, kb, kb, table, two, two, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention(torch.randn(2, 4, 16), kb, kb, table, two, two[:1], 1.0)
    with pytest.raises(ValueError, match="extend_lens"):
        extend_attention(torch.randn(2, 4, 16), kb, kb, table, two, two, two, two[:1], 1, 1.0)
    with pytest.raises(ValueError, match="loc"):
        store_kv(kb[:3], kb[:3], kb, kb, two)


def _forward_batch(mode, prefix_lens, extend_lens, page_size, dtype, gen, pad_rows=0, hkv=2, d=32):
    """A hand-built batch over a 2-layer pool whose prefix slots hold random KV. Padded rows
    (as a CUDA graph pads a decode batch) have seq_len 1 on a zero row: scratch slot 0."""
    kv = KVPool(2, SLOTS // page_size, page_size, hkv, d, dtype, "cpu")
    for buf in kv.k + kv.v:
        buf.copy_(torch.randn(buf.shape, generator=gen))
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    table, rows = _table(seq_lens, page_size, gen)
    req_to_token = ReqToTokenPool(len(seq_lens) + 2, MAX_CTX, "cpu").table
    req_to_token.copy_(table)
    loc = [table[r, p:s] for r, p, s in zip(rows.tolist(), prefix_lens, seq_lens)]
    scratch_row = next(i for i in range(len(table)) if i not in rows.tolist())
    loc += [torch.zeros(1, dtype=torch.int64)] * pad_rows
    rows = torch.cat([rows, torch.full((pad_rows,), scratch_row)])
    prefix_lens, extend_lens = prefix_lens + [0] * pad_rows, extend_lens + [1] * pad_rows
    seq_lens = seq_lens + [1] * pad_rows
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, extend_lens)])
    ext = torch.tensor(extend_lens)
    return ForwardBatch(
        mode=mode, input_ids=torch.zeros(len(positions), dtype=torch.int64), positions=positions,
        out_cache_loc=torch.cat(loc), req_pool_indices=rows, seq_lens=torch.tensor(seq_lens),
        prefix_lens=torch.tensor(prefix_lens), extend_lens=ext, extend_start_loc=torch.cumsum(ext, 0) - ext,
        seq_lens_cpu=seq_lens, prefix_lens_cpu=prefix_lens, extend_lens_cpu=extend_lens,
        req_to_token=req_to_token, kv=kv)


def _run(backend, fb, q, k, v):
    fb.attn_meta = backend.prepare(fb)
    return backend.forward(q, k, v, 1, fb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode,prefix_lens,extend_lens,pad_rows", [
    (ForwardMode.EXTEND, [0, 12, 7, 0, 30], [9, 1, 20, 1, 3], 0),
    (ForwardMode.DECODE, [0, 39, 16], [1, 1, 1], 2),
], ids=["extend", "decode"])
def test_triton_backend_matches_torch_backend(dtype, mode, prefix_lens, extend_lens, pad_rows):
    gen = torch.Generator().manual_seed(3)
    page_size = 16 if mode == ForwardMode.DECODE else 1
    fb = _forward_batch(mode, prefix_lens, extend_lens, page_size, dtype, gen, pad_rows)
    fb_ref = _forward_batch(mode, prefix_lens, extend_lens, page_size, dtype, torch.Generator().manual_seed(3), pad_rows)
    T = fb.num_tokens
    # Views of a fused qkv projection, as the model passes them.
    qkv = torch.randn(T, (4 + 2 + 2) * 32, generator=gen).to(dtype)
    q, k, v = (x.view(T, -1, 32) for x in qkv.split([4 * 32, 2 * 32, 2 * 32], dim=-1))
    kw = dict(num_heads=4, num_kv_heads=2, head_dim=32)
    out = _run(TritonBackend(num_kv_splits=4, **kw), fb, q, k, v)
    ref = _run(TorchBackend(**kw), fb_ref, q, k, v)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    for layer in range(2):  # the new KV went to the same slots of layer 1 only
        assert torch.equal(fb.kv.k[layer], fb_ref.kv.k[layer])
        assert torch.equal(fb.kv.v[layer], fb_ref.kv.v[layer])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shared_prefix_decode_equals_plain(dtype):
    """Decode rows whose first 40 slots are the same: attending to that prefix once for the
    group (merged by log-sum-exp) equals attending row by row."""
    from worker.engine.batch import SharedGroup
    gen = torch.Generator().manual_seed(5)
    prefix_lens, p = [52, 47, 60, 41], 40
    fb = _forward_batch(ForwardMode.DECODE, prefix_lens, [1] * 4, 1, dtype, gen)
    rows = fb.req_pool_indices.tolist()
    for r in rows[1:]:  # the rows borrow row 0's first p slots, as from the radix cache
        fb.req_to_token[r, :p] = fb.req_to_token[rows[0], :p]
    q = torch.randn(4, 4, 32, generator=gen).to(dtype)
    k, v = (torch.randn(4, 2, 32, generator=gen).to(dtype) for _ in range(2))
    be = TorchBackend(num_heads=4, num_kv_heads=2, head_dim=32, cpu_kernel=False)  # groups: torch's
    plain = _run(be, fb, q, k, v)
    fb.shared = [SharedGroup([0, 1, 2, 3], p)]
    fb.attn_meta = be.prepare(fb)
    assert fb.attn_meta.shared and not fb.attn_meta.dec  # the grouped path really ran
    shared = be.forward(q, k, v, 1, fb)
    torch.testing.assert_close(shared, plain, **TOL[dtype])


HAVE_CC = cpu_build.compiler() is not None


def _kernels_against_torch(fb, gen, hq, hkv, d):
    """One layer of fb through the C kernels and through the torch path (SDPA over gathered
    pages), from the same pools: (the kernels' output, torch's, the kernels' metadata)."""
    T = fb.num_tokens
    q = torch.randn(T, hq, d, generator=gen)
    k, v = (torch.randn(T, hkv, d, generator=gen) for _ in range(2))
    kw = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d)
    kernel, plain = TorchBackend(**kw), TorchBackend(cpu_kernel=False, **kw)
    assert kernel.kernel is not None and kernel.ext_kernel is not None, \
        "a C compiler is here, so the kernels must build"
    pools = [buf.clone() for buf in fb.kv.k + fb.kv.v]
    out = _run(kernel, fb, q, k, v)
    meta = fb.attn_meta
    for buf, saved in zip(fb.kv.k + fb.kv.v, pools):
        buf.copy_(saved)
    return out, _run(plain, fb, q, k, v), meta


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the CPU kernel is not built here")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 48), (16, 1, 16), (2, 1, 128)])
def test_cpu_kernel_matches_torch_path(page_size, hq, hkv, d):
    """Decode rows of lengths around the kernel's 16-key blocks, beside an extend row, two
    rows borrowing a third's first slots as from the radix cache."""
    gen = torch.Generator().manual_seed(7)
    prefix_lens, extend_lens = [0, 30, 31, 32, 95, 12, 40, 40], [1, 1, 1, 1, 1, 9, 1, 1]
    fb = _forward_batch(ForwardMode.EXTEND, prefix_lens, extend_lens, page_size, torch.float32,
                        gen, hkv=hkv, d=d)
    rows = fb.req_pool_indices.tolist()
    for r in rows[6:]:
        fb.req_to_token[r, :32] = fb.req_to_token[rows[4], :32]
    out, ref, meta = _kernels_against_torch(fb, gen, hq, hkv, d)
    assert meta.kernel is not None and len(meta.kernel.rows) == 7
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the CPU kernel is not built here")
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 48), (16, 1, 16)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (20, 0.0), (0, 30.0)])
def test_cpu_decode_kernel_row_alone_equals_row_in_a_batch(hq, hkv, d, window, softcap):
    """With fewer rows than threads the kernel splits a row's kv heads over the threads (one
    task each), else it runs whole rows: each head's output is the same floats either way
    (the batch on one thread against each row alone on two or more), and the same as torch's
    path within float error. (16, 1, 16): one kv head, never split."""
    from worker.engine.kernels import cpu_decode
    fn = cpu_decode.load(torch.float32, hq, hkv, d)
    gen = torch.Generator().manual_seed(3)
    lens = [1, 17, 48, 95, 33, 64, 5, 16]
    table, req = _table(lens, 16, gen)
    kc, vc = _buffers(16, hkv, d, torch.float32, gen)
    q = torch.randn(len(lens), hq, d, generator=gen)
    lens_t = torch.tensor(lens)
    batch = torch.full_like(q, math.nan)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # whole rows, however many cores this machine has
        cpu_decode.decode_attention(fn, q, batch, kc, vc, table, torch.arange(len(lens)), req, lens_t,
                                    d ** -0.5, window, softcap)
        torch.set_num_threads(max(threads, 2))  # one row, two threads at least: split by kv head
        for b in range(len(lens)):
            alone = torch.full_like(q, math.nan)
            cpu_decode.decode_attention(fn, q, alone, kc, vc, table, torch.tensor([b]), req[b:b + 1],
                                        lens_t[b:b + 1], d ** -0.5, window, softcap)
            assert torch.equal(alone[b], batch[b]), b
    finally:
        torch.set_num_threads(threads)
    for b, n in enumerate(lens):  # against plain attention over the row's visible keys
        keys = table[req[b], max(0, n - window) if window else 0:n]
        k, v = kc[keys].repeat_interleave(hq // hkv, 1), vc[keys].repeat_interleave(hq // hkv, 1)
        s = torch.einsum("hd,thd->ht", q[b], k) * d ** -0.5
        s = softcap * torch.tanh(s / softcap) if softcap else s
        ref = torch.einsum("ht,thd->hd", torch.softmax(s, -1), v)
        torch.testing.assert_close(batch[b], ref, atol=2e-6, rtol=1e-5)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the CPU kernel is not built here")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 48), (16, 1, 16), (2, 1, 128)])
def test_cpu_prefill_kernel_matches_torch_path(page_size, hq, hkv, d):
    """Prefill rows with and without a cached prefix, of lengths around the kernel's 16-key
    blocks and its token blocks (48 query heads a task), beside decode rows."""
    gen = torch.Generator().manual_seed(11)
    prefix_lens, extend_lens = [0, 0, 15, 32, 7, 0, 40], [1, 17, 2, 40, 16, 60, 1]
    fb = _forward_batch(ForwardMode.EXTEND, prefix_lens, extend_lens, page_size, torch.float32,
                        gen, hkv=hkv, d=d)
    out, ref, meta = _kernels_against_torch(fb, gen, hq, hkv, d)
    assert meta.ext_kernel is not None and not meta.ext
    assert meta.ext_kernel.counts.tolist() == [17, 2, 40, 16, 60]
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the CPU kernel is not built here")
def test_cpu_kernel_only_for_fp32():
    gen = torch.Generator().manual_seed(8)
    fb = _forward_batch(ForwardMode.DECODE, [5, 40], [1, 1], 16, torch.float16, gen)
    be = TorchBackend(num_heads=4, num_kv_heads=2, head_dim=32)
    assert be.kernel is not None
    fb.attn_meta = be.prepare(fb)
    assert fb.attn_meta.kernel is None and fb.attn_meta.dec  # the fp16 pool: torch's path
    be16 = TorchBackend(num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float16)
    assert be16.kernel is None and be16.uses_shared_prefixes  # torch's flash kernel groups them


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the CPU kernel is not built here")
def test_cpu_kernel_head_dims_it_cannot_take_stay_on_torch():
    """A head_dim that is not a whole number of the CPU's vectors (every x86 and NEON vector
    is 4, 8 or 16 floats: 20 is none), or one past 16 of them: the torch path, not an error."""
    for d in (20, 4096):
        be = TorchBackend(num_heads=2, num_kv_heads=1, head_dim=d)
        assert be.kernel is None and be.uses_shared_prefixes


def test_cpu_kernel_build_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    """No compiler, or one that fails: no kernel (the torch path runs), said in the log with
    what it costs; with a compiler, the build is cached under its hash and not redone; once
    built, it is used with no compiler at all."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    caplog.set_level(logging.WARNING, "fanout.engine")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert cpu_build.build("cpu_decode") is None
    assert "the build with " + str(tmp_path / "no-such-cc") + " failed" in caplog.text
    monkeypatch.setenv("CC", shutil.which("false"))
    assert cpu_build.build("cpu_decode") is None
    assert "the build with" in caplog.text and "about a third of its CPU speed" in caplog.text
    assert not list((tmp_path / "fanout" / "kernels").glob("*"))  # no half-written file left
    monkeypatch.delenv("CC")
    cc, path = cpu_build.compiler(), os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # no cc, no gcc
    caplog.clear()
    assert cpu_build.compiler() is None and cpu_build.build("cpu_decode") is None
    assert "no build of it in" in caplog.text and "no C compiler to make one" in caplog.text
    if cc is None:
        return
    monkeypatch.setenv("PATH", path)  # (the compiler calls the assembler and linker from PATH)
    first = cpu_build.build("cpu_decode")
    assert first and os.path.isfile(first)
    when = os.stat(first).st_mtime_ns
    assert cpu_build.build("cpu_decode") == first and os.stat(first).st_mtime_ns == when
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # the compiler gone: the build in the cache is used
    assert cpu_build.compiler() is None and cpu_build.build("cpu_decode") == first


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the CPU kernel is not built here")
@pytest.mark.parametrize("n,k", [(96, 64), (49, 33), (1, 7), (300, 576)])
def test_cpu_linear_matches_torch(n, k):
    """Every row count around the kernel's row tile (1-20), columns not a multiple of a
    panel, a bias or none, rows with a stride (a view of a wider tensor): x W^T (+ b) as
    torch's, and silu(x Wg^T) * (x Wu^T) as torch's for the MLP's fused call."""
    assert cpu_linear.load()
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w, g, u = (torch.randn(n, k, generator=gen) / k ** 0.5 for _ in range(3))
    b = torch.randn(n, generator=gen)
    packed, gate_up = cpu_linear.pack(w), cpu_linear.pack_gate_up(g, u)
    for m in range(1, 21):
        wide = torch.randn(m, k + 5, generator=gen)
        for x in (wide[:, :k].contiguous(), wide[:, 2:k + 2]):
            exact = x.double()
            torch.testing.assert_close(cpu_linear.linear(x, packed, b),
                                       (exact @ w.double().T + b.double()).float(), atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(cpu_linear.linear(x, packed),
                                       (exact @ w.double().T).float(), atol=2e-5, rtol=1e-5)
            ref = torch.nn.functional.silu(exact @ g.double().T) * (exact @ u.double().T)
            torch.testing.assert_close(cpu_linear.silu_mul(x, gate_up), ref.float(), atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the CPU kernel is not built here")
def test_cpu_linear_rows_do_not_depend_on_the_batch():
    """A row's outputs are bit for bit the same alone or among others: each sums its products
    in k order whatever the rows around it (so a request's logits do not hang on its batch)."""
    assert cpu_linear.load()
    gen = torch.Generator().manual_seed(3)
    w = cpu_linear.pack(torch.randn(200, 96, generator=gen))
    x = torch.randn(37, 96, generator=gen)
    whole = cpu_linear.linear(x, w)
    for i in (0, 8, 36):
        assert torch.equal(cpu_linear.linear(x[i:i + 1], w), whole[i:i + 1])
    assert torch.equal(cpu_linear.linear(x[5:30], w), whole[5:30])


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the CPU kernel is not built here")
def test_cpu_linear_in_passes_of_rows():
    """Rows beyond one pass (512 KB of x: 32 rows of 4,096 columns), the last pass partial:
    every row as torch's, and as the same row alone, bit for bit."""
    assert cpu_linear.load()
    gen = torch.Generator().manual_seed(4)
    w, g, u = (torch.randn(40, 4096, generator=gen) / 64 for _ in range(3))
    x = torch.randn(77, 4096, generator=gen)
    packed, gate_up = cpu_linear.pack(w), cpu_linear.pack_gate_up(g, u)
    whole, mlp = cpu_linear.linear(x, packed), cpu_linear.silu_mul(x, gate_up)
    exact = x.double()
    torch.testing.assert_close(whole, (exact @ w.double().T).float(), atol=2e-5, rtol=1e-5)
    ref = torch.nn.functional.silu(exact @ g.double().T) * (exact @ u.double().T)
    torch.testing.assert_close(mlp, ref.float(), atol=2e-5, rtol=1e-5)
    for i in (0, 31, 32, 70, 76):
        assert torch.equal(cpu_linear.linear(x[i:i + 1], packed), whole[i:i + 1])
        assert torch.equal(cpu_linear.silu_mul(x[i:i + 1], gate_up), mlp[i:i + 1])


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the CPU kernel is not built here")
def test_cpu_linear_rejects_what_it_cannot_take():
    assert cpu_linear.load()
    w = cpu_linear.pack(torch.randn(8, 16))
    for x in (torch.randn(2, 15), torch.randn(2, 16, dtype=torch.float64), torch.randn(16)):
        with pytest.raises(ValueError, match="cpu_linear"):
            cpu_linear.linear(x, w)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the CPU kernel is not built here")
def test_cpu_pointwise_matches_torch():
    """Residual add + RMSNorm, and RoPE + the K/V store, as the model's torch ops do them;
    the caller's residual is left as it was, and a strided x is taken."""
    from worker.engine.kernels import cpu_pointwise
    from worker.engine.models.llama import RMSNorm
    from worker.engine.models.rope import RotaryEmbedding, apply_rotary
    assert cpu_pointwise.load()
    gen = torch.Generator().manual_seed(5)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96, generator=gen)
    x, res = torch.randn(70, 96, generator=gen), torch.randn(70, 96, generator=gen)
    kept = res.clone()
    with torch.no_grad():
        ref_out, ref_sum = norm(x, res)
        out, total = cpu_pointwise.add_rmsnorm(x.clone(), res, norm.weight, norm.eps)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(total, ref_sum, atol=0, rtol=0)
        assert torch.equal(res, kept)
        wide = torch.randn(70, 100, generator=gen)
        out, _ = cpu_pointwise.add_rmsnorm(wide[:, 2:98], None, norm.weight, norm.eps)
        torch.testing.assert_close(out, norm(wide[:, 2:98]), atol=1e-5, rtol=1e-5)
    hq, hkv, d, T = 6, 2, 32, 9
    rope = RotaryEmbedding(d, 64, 10000.0, None)
    positions = torch.tensor([0, 5, 6, 7, 8, 30, 31, 62, 63])
    cos, sin = rope(positions, torch.float32)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=gen)
    kc, vc = torch.zeros(80, hkv, d), torch.zeros(80, hkv, d)
    slots = torch.randperm(80, generator=gen)[:T]
    q = cpu_pointwise.rope_store(qkv, cos, sin, hq, hkv, kc, vc, slots)
    qr, kr, vr = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    ref_q, ref_k = apply_rotary(qr.view(T, hq, d), kr.view(T, hkv, d), cos, sin)
    assert torch.equal(q, ref_q) and torch.equal(kc[slots], ref_k)  # no FMA: torch's roundings
    assert torch.equal(vc[slots], vr.view(T, hkv, d))
    others = torch.ones(80, dtype=torch.bool)
    others[slots] = False
    assert not kc[others].any() and not vc[others].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lora_add(dtype):
    """kernels/lora.py (the GPU's batched LoRA) against its torch reference and against the
    CPU's path (lora.Lora.add): tokens of three slots and of the base interleaved, unevenly,
    a projection of three sub-projections (q, k, v's slices) with block-diagonal B."""
    from types import SimpleNamespace
    from worker.engine.kernels.lora import lora_add, lora_ref
    from worker.engine.lora import Lora, Loras
    gen = torch.Generator().manual_seed(0)
    T, K, R, S = 7, 24, 4, 4
    subs = [(0, 16), (16, 24), (24, 32)]
    owner = SimpleNamespace(max_rank=R, max_loras=S - 1, current=None)
    lora = Lora(owner, subs, K, dtype, "cpu")
    for slot in range(1, S):
        lora.a[slot] = torch.randn(len(subs) * R, K, generator=gen).to(dtype)
        for k, (lo, hi) in enumerate(subs):
            lora.b[slot, lo:hi, k * R:(k + 1) * R] = torch.randn(hi - lo, R, generator=gen).to(dtype)
    slots = torch.tensor([1, 0, 3, 1, 2, 0, 3], dtype=torch.int32)
    x = torch.randn(T, K, generator=gen).to(dtype)
    out = torch.randn(T, 32, generator=gen).to(dtype)
    want = lora_ref(x, out.clone(), lora.a, lora.b, slots)
    got = lora_add(x, out.clone(), lora.a, lora.b, slots)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[1], out[1]) and torch.equal(got[5], out[5])  # the base's rows untouched
    assert not torch.allclose(got[0], out[0])
    for picked in ([1, 0, 3, 1, 2, 0, 3], [0, 2, 2, 0, 3, 3, 0], [1, 1, 0, 0, 1, 0, 0]):  # gathered, a span, one
        slots = torch.tensor(picked, dtype=torch.int32)
        owner.current = Loras.batch(picked, [1] * T, "cpu")
        torch.testing.assert_close(lora.add(x, out.clone()), lora_ref(x, out.clone(), lora.a, lora.b, slots),
                                   **TOL[dtype])


@pytest.mark.parametrize("window", [5, 20])
@pytest.mark.parametrize("page_size", [1, 16])
def test_sliding_window_on_every_path(window, page_size):
    """A layer with a sliding window, through the torch path, the C kernels and the Triton
    kernels (decode and extend), against the plain reference: rows longer and shorter than
    the window, with and without a cached prefix; a window under one 16-key block (5) and
    over one (20). The window changes the output, so a path that ignored it would fail."""
    hq, hkv, d = 4, 2, 32
    cases = [(ForwardMode.EXTEND, [0, 12, 7, 0, 30, 44], [9, 1, 20, 40, 3, 1]),
             (ForwardMode.DECODE, [0, 39, 16, 4], [1, 1, 1, 1])]
    for mode, prefix_lens, extend_lens in cases:
        gen = torch.Generator().manual_seed(13)
        fb = _forward_batch(mode, prefix_lens, extend_lens, page_size, torch.float32, gen, hkv=hkv, d=d)
        pools = [buf.clone() for buf in fb.kv.k + fb.kv.v]
        T = fb.num_tokens
        q = torch.randn(T, hq, d, generator=gen)
        k, v = (torch.randn(T, hkv, d, generator=gen) for _ in range(2))
        kw = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, windows=(0, window))
        backends = {"torch": TorchBackend(cpu_kernel=False, **kw), "triton": TritonBackend(num_kv_splits=4, **kw)}
        if HAVE_CC:
            backends["c"] = TorchBackend(**kw)
            assert backends["c"].kernel is not None
        ref = full = None
        for name, be in backends.items():
            for buf, saved in zip(fb.kv.k + fb.kv.v, pools):
                buf.copy_(saved)
            out = _run(be, fb, q, k, v)  # layer 1: windowed
            if ref is None:
                args = (q, fb.kv.k[1], fb.kv.v[1], fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                        fb.extend_start_loc, fb.extend_lens)
                ref = extend_attention_ref(*args, be.scale, window=window)
                full = extend_attention_ref(*args, be.scale)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5, msg=lambda m: f"{name}, {mode}: {m}")
            assert not torch.allclose(out, full, atol=1e-3)
            assert be.window(0) == 0 and be.window(1) == window


@pytest.mark.parametrize("window", [0, 20])
def test_soft_capped_scores_on_every_path(window):
    """Gemma 2's soft-capped attention scores (cap * tanh(s / cap)), with and without a sliding
    window, through the torch path, the C kernels and the Triton kernels (decode and extend),
    against the plain reference; the cap changes the output, so a path that ignored it fails."""
    hq, hkv, d, cap = 4, 2, 32, 2.0
    cases = [(ForwardMode.EXTEND, [0, 12, 7, 0, 30, 44], [9, 1, 20, 40, 3, 1]),
             (ForwardMode.DECODE, [0, 39, 16, 4], [1, 1, 1, 1])]
    for mode, prefix_lens, extend_lens in cases:
        gen = torch.Generator().manual_seed(17)
        fb = _forward_batch(mode, prefix_lens, extend_lens, 16, torch.float32, gen, hkv=hkv, d=d)
        pools = [buf.clone() for buf in fb.kv.k + fb.kv.v]
        T = fb.num_tokens
        q = torch.randn(T, hq, d, generator=gen) * 3  # scores well past the cap
        k, v = (torch.randn(T, hkv, d, generator=gen) for _ in range(2))
        kw = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, windows=(window, window), softcap=cap)
        backends = {"torch": TorchBackend(cpu_kernel=False, **kw), "triton": TritonBackend(num_kv_splits=4, **kw)}
        if HAVE_CC:
            backends["c"] = TorchBackend(**kw)
        ref = plain = None
        for name, be in backends.items():
            for buf, saved in zip(fb.kv.k + fb.kv.v, pools):
                buf.copy_(saved)
            out = _run(be, fb, q, k, v)
            if ref is None:
                args = (q, fb.kv.k[1], fb.kv.v[1], fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
                        fb.extend_start_loc, fb.extend_lens, be.scale)
                ref = extend_attention_ref(*args, window=window, softcap=cap)
                plain = extend_attention_ref(*args, window=window)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5, msg=lambda m: f"{name}, {mode}: {m}")
            assert not torch.allclose(out, plain, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_equals_the_expert_loop(dtype):
    """The GPU's grouped matmuls (kernels/fused_moe.py, in the interpreter) against the CPU's
    loop over experts (models/moe.py) on the same weights: 37 tokens, 5 experts, 2 a token,
    routed unevenly (one expert with no token); align puts every pair once, in blocks of one
    expert each."""
    from worker.engine.kernels import fused_moe
    from worker.engine.models.config import MoEConfig
    from worker.engine.models.moe import MoE
    g = torch.Generator().manual_seed(23)
    moe = MoE(MoEConfig(5, 2, 48, True, (0,), False), hidden_size=32)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        moe.router.weight[:, 0] = torch.tensor([1.0, 1.0, 1.0, 1.0, -10.0])  # expert 4: never picked
    moe = moe.to(dtype)
    x = torch.randn(37, 32, generator=g)
    x[:, 0] = 5.0
    x = x.to(dtype)
    weights, experts = moe.route(x)
    counts = torch.bincount(experts.flatten(), minlength=5).tolist()
    assert counts[4] == 0 and len(set(counts[:4])) > 1, counts
    ids, blocks = fused_moe.align(experts, 5)
    real = ids[ids < 74]
    assert sorted(real.tolist()) == list(range(74))  # every pair once
    for b, e in enumerate(blocks.tolist()):
        pairs = ids[b * fused_moe.BLOCK_M:(b + 1) * fused_moe.BLOCK_M]
        pairs = pairs[pairs < 74]
        assert e == -1 and not len(pairs) or (experts.flatten()[pairs] == e).all()
    with torch.inference_mode():
        torch.testing.assert_close(moe.fused(x, weights, experts), moe.loop(x, weights, experts), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [3, 40])
def test_w8_linear_equals_x_times_the_dequantized_weight(dtype, rows):
    """The GPU's 8-bit weight matmul (kernels/w8_linear.py, in the interpreter): int8 codes
    widened in registers, the row's scale applied after the sum over K (70 x 96: partial
    tiles both ways), = x times the dequantized weight; the quantization is within half a
    step of each row's scale, and fp8's (e4m3, 3 mantissa bits) within 1/16 of the value."""
    from worker.engine.kernels import w8_linear
    g = torch.Generator().manual_seed(5)
    w = torch.randn(70, 96, generator=g)
    q = w8_linear.quantize(w, "int8")
    assert q.q.dtype == torch.int8 and q.nbytes == 70 * 96 + 4 * 70
    assert ((q.dequantize() - w).abs() <= q.scale[:, None] / 2 + 1e-6).all()
    f8 = w8_linear.quantize(w, "fp8")
    assert ((f8.dequantize() - w).abs() <= w.abs() / 16 + f8.scale[:, None] * 2 ** -9).all()
    x = torch.randn(rows, 96, generator=g).to(dtype)
    bias = torch.randn(70, generator=g).to(dtype)
    want = (x.float() @ q.dequantize().T + bias.float()).to(dtype)
    torch.testing.assert_close(w8_linear.linear(x, q, bias), want, **TOL[dtype])
    with pytest.raises(ValueError, match="weight format 'int4'"):
        w8_linear.quantize(w, "int4")
