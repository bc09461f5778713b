"""Quantized weights on the CPU (kernels/cpu_quant.c): GGUF's blocks read as gguf reads them,
and the kernel's products equal the fp32 kernel's on the dequantized weight, float for float."""
import os
import platform
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from bench.quant_kernel import random_blocks
from worker.engine.kernels import cpu_build, cpu_linear, cpu_quant

pytestmark = pytest.mark.skipif(not (cpu_quant.load() and cpu_linear.load()), reason="no C compiler")

TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q8_0"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference(type_name: str, data: np.ndarray, n: int, k: int) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[type_name]
    return torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(n, k).astype(np.float32))


@pytest.mark.parametrize("type_name", TYPES)
def test_blocks_read_as_gguf_dequantizes_them(type_name):
    n, k = 40, 512
    data = random_blocks(type_name, n, k)
    w = cpu_quant.from_blocks(type_name, data, n, k)
    assert torch.equal(w.dequantize(), reference(type_name, data, n, k))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 70, 300])
def test_the_kernel_equals_the_fp32_kernel_on_the_dequantized_weight(type_name, rows):
    """K = 288 (a 32-weight group past the kernel's 64-step pieces), N = 100 (a partial
    panel): each output float equals cpu_linear's, so a row's output is the same in any batch."""
    n, k = 100, 288 if type_name != "Q4_K" else 512
    w = cpu_quant.from_blocks(type_name, random_blocks(type_name, n, k), n, k)
    x = torch.randn(rows, k)
    bias = torch.randn(n)
    dense = w.dequantize()
    want = cpu_linear.linear(x, cpu_linear.pack(dense), bias)
    assert torch.equal(cpu_quant.linear(x, cpu_quant.pack(w), bias), want)
    torch.testing.assert_close(want, x @ dense.T + bias, rtol=1e-3, atol=1e-3)


def dot_reference(x: torch.Tensor, w: cpu_quant.Quantized) -> torch.Tensor:
    """The dot way: x rounded to 8 bits per 32 as the kernel rounds it (scale amax / 127 and
    its inverse in float32, half away from zero: llama.cpp's Q8 blocks), then in float64 each
    group's integer sum scaled by d dx, plus the offset times the rounded x's sum: the
    weights times the rounded x."""
    x32 = x.view(x.shape[0], -1, 32)
    d32 = x32.abs().amax(-1, keepdim=True) / 127
    v = (x32 * torch.where(d32 > 0, 1 / d32, 0)).double()
    xq = torch.sign(v) * torch.floor(v.abs() + 0.5)
    dx = d32.double()
    q = w.q.view(torch.int8).double() if w.kind == 2 else w.q.double()
    qg = q.view(q.shape[0], -1, 32)
    sums = torch.einsum("mgk,ngk->mng", xq, qg)
    return (sums * w.d.double()[None] * dx[:, None, :, 0]
            + w.offset().double()[None] * (dx[..., 0] * xq.sum(-1))[:, None, :]).sum(-1)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 70])
def test_the_dot_way_is_llamacpps_rounding_and_batch_free(type_name, rows):
    """quantization q8: each output within float32 rounding (of the outputs' scale: sums of
    large products cancel) of the reference of x rounded to 8 bits; a row's output the same
    float alone as in its batch; and near the exact product (the rounding of x costs ~1% of
    the outputs' scale on random weights)."""
    n, k = 100, 288 if type_name != "Q4_K" else 512
    w = cpu_quant.from_blocks(type_name, random_blocks(type_name, n, k), n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0  # a group of zeros: scale 0
    bias = torch.randn(n)
    y = cpu_quant.linear(x, cpu_quant.pack(w, dot=True), bias)
    ref = dot_reference(x, w) + bias.double()
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(cpu_quant.linear(x[-1:], cpu_quant.pack(w, dot=True), bias), y[-1:])
    exact = x @ w.dequantize().T + bias
    assert (y - exact).abs().max() < 0.03 * exact.abs().max()


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_gate_and_up_in_one_call(type_name):
    n, k = 100, 256
    gate = cpu_quant.from_blocks(type_name, random_blocks(type_name, n, k, seed=1), n, k)
    up = cpu_quant.from_blocks(type_name, random_blocks(type_name, n, k, seed=2), n, k)
    x = torch.randn(13, k)
    want = cpu_linear.silu_mul(x, cpu_linear.pack_gate_up(gate.dequantize(), up.dequantize()))
    assert torch.equal(cpu_quant.silu_mul(x, cpu_quant.pack_gate_up(gate, up)), want)
    fast = cpu_quant.silu_mul(x, cpu_quant.pack_gate_up(gate, up, dot=True))
    gate_y = dot_reference(x, gate)
    torch.testing.assert_close(fast.double(), gate_y * torch.sigmoid(gate_y) * dot_reference(x, up),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"cpu_quant: x \(13, 128\) torch.float32, weight takes 256 float32 columns"):
        cpu_quant.linear(x[:, :128], cpu_quant.pack(gate))


@pytest.mark.parametrize("type_name", TYPES)
def test_rows_are_the_dequantized_rows(type_name):
    """An embedding lookup from the lm_head's panels."""
    n, k = 100, 256
    w = cpu_quant.from_blocks(type_name, random_blocks(type_name, n, k), n, k)
    ids = torch.tensor([0, 99, 47, 48, 47])
    assert torch.equal(cpu_quant.rows(ids, cpu_quant.pack(w)), w.dequantize()[ids])
    for bad in (100, -1):  # checked before any row is written; the message names the id
        with pytest.raises(IndexError, match=rf"\[0, 100\), got {bad}$"):
            cpu_quant.rows(torch.tensor([3, bad, 4]), cpu_quant.pack(w))
    big = torch.arange(n).repeat(3)  # enough rows to run on every thread
    assert torch.equal(cpu_quant.rows(big, cpu_quant.pack(w)), w.dequantize()[big])


def test_rows_permuted_and_joined_stay_exact():
    """The loader permutes Llama's q/k rows and joins gate and up, on the codes."""
    n, k = 64, 128
    a = cpu_quant.from_blocks("Q4_1", random_blocks("Q4_1", n, k, seed=3), n, k)
    b = cpu_quant.from_blocks("Q4_1", random_blocks("Q4_1", n, k, seed=4), n, k)
    perm = torch.randperm(n)
    assert torch.equal(a.rows(perm).dequantize(), a.dequantize()[perm])
    assert torch.equal(cpu_quant.Quantized.cat([a, b]).dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="different kinds"):
        cpu_quant.Quantized.cat([a, cpu_quant.from_blocks("Q8_0", random_blocks("Q8_0", n, k), n, k)])


def test_scales_are_kept_as_float16_only_where_exact():
    """Q4_0, Q4_1 and Q8_0 keep the file's float16 scales (20 bytes per 32 Q4_1 weights);
    Q4_K's products of two scales stay float32, and so does a Q4_0 whose offset -8 d
    overflows float16. Every way gives the same floats as before."""
    n, k = 100, 512
    for type_name, half in (("Q4_0", True), ("Q4_1", True), ("Q8_0", True), ("Q4_K", False)):
        w = cpu_quant.from_blocks(type_name, random_blocks(type_name, n, k), n, k)
        assert cpu_quant.pack(w).half is half and w.half is half, type_name
    w = cpu_quant.from_blocks("Q4_1", random_blocks("Q4_1", n, k), n, k)
    assert w.nbytes == n * k * 20 // 32
    big = cpu_quant.from_blocks("Q4_0", random_blocks("Q4_0", n, k), n, k)
    big.d[3, 2] = 16384.0  # a float16; -8 d is not
    packed = cpu_quant.pack(big)
    assert not packed.half and packed.scales.dtype == torch.float32
    x = torch.randn(5, k)
    dense = big.dequantize()
    assert torch.equal(cpu_quant.linear(x, packed), cpu_linear.linear(x, cpu_linear.pack(dense)))
    assert torch.equal(cpu_quant.rows(torch.tensor([3, 7]), packed), dense[[3, 7]])


def test_eight_bit_weights_are_the_gpus(llama_path):
    """int8 / fp8 quantize every linear layer for the GPU's Triton kernel (tests/test_kernels.py
    checks it in the interpreter; bench/gpu.py runs the engine with it); a CPU engine says
    what it has instead, and an unknown format is named."""
    from worker.engine import Engine, EngineConfig
    with pytest.raises(ValueError, match="quantization int8: 8-bit weights run on a GPU; on a CPU, a GGUF"):
        Engine(llama_path, quantization="int8")
    with pytest.raises(ValueError, match=r"quantization: unknown 'int4' \(use one of auto, q8, none, int8, fp8\)"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match=r"quantization q8: the codes' products run on a CPU in float32, this is cpu in bfloat16 \(on a GPU"):
        Engine(llama_path, quantization="q8", dtype="bfloat16")


def test_the_kernel_benchmark_runs():
    """bench/quant_kernel.py at one row and two copies: each way timed, in cache and from
    memory, with the weight's rate."""
    from bench import quant_kernel
    rows = quant_kernel.main(["--types", "Q4_1", "--rows", "1", "--copies", "2"])
    assert [(r["shape"], r["rows"]) for r in rows] == [("gate/up", 1), ("down", 1)]
    for r in rows:
        assert all(r[f"{w}_cache_us"] > 0 for w in ("exact", "dot", "fp32"))
        assert r["exact_memory_gb_s"] > 0 and r["dot_memory_gb_s"] > 0 and r["dot_vs_exact_cache"] > 0


def isa_outputs() -> dict:
    """Both ways' outputs for fixed weights and rows: what each instruction set's build must
    give alike."""
    out = {}
    for t in ("Q4_1", "Q8_0", "Q4_K"):
        n, k = 100, 512
        w = cpu_quant.from_blocks(t, random_blocks(t, n, k), n, k)
        for rows in (1, 9, 70):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            for dot in (False, True):
                out[t, rows, dot] = cpu_quant.linear(x, cpu_quant.pack(w, dot=dot))
    return out


# A child that builds the kernel for another instruction set (before anything loads it) and
# saves isa_outputs() from that build.
OTHER_ISA = """
import sys
import torch
from worker.engine.kernels import cpu_build
cpu_build.FLAGS[cpu_build.FLAGS.index("-march=native")] = "-march=" + sys.argv[1]
sys.path.insert(0, "tests")
from test_quant import isa_outputs
torch.save(isa_outputs(), sys.argv[2])
"""


# What each level's build needs of the CPU that runs it
LEVELS = {"x86-64-v3": {"avx2", "fma", "f16c", "bmi2"},
          "x86-64-v4": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the other x86 instruction sets")
@pytest.mark.parametrize("march", sorted(LEVELS))
def test_the_same_floats_on_other_instruction_sets(march, tmp_path):
    """The kernel built for AVX2 + F16C (v3: maddubs, 8 lanes) and AVX-512 without VNNI (v4)
    gives the floats this machine's build gives, both ways: every sum is a chain of FMAs in
    k or group order whatever the vector width, and the integer sums are exact. CI runs on
    one machine; this keeps the paths it does not take honest."""
    missing = LEVELS[march] - set(cpu_build._cpu_flags().split())
    if missing:
        pytest.skip(f"this CPU cannot run a {march} build (no {', '.join(sorted(missing))})")
    path = tmp_path / "out.pt"
    done = subprocess.run([sys.executable, "-c", OTHER_ISA, march, str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs, ours = torch.load(path), isa_outputs()
    assert theirs.keys() == ours.keys()
    for key, y in ours.items():
        assert torch.equal(theirs[key], y), key
