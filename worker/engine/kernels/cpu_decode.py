"""The CPU decode-attention kernel (cpu_decode.c): built once per machine with the C compiler,
cached, and called through ctypes.

Why C: on a CPU, torch can attend over paged KV only after gathering each row's keys and
values into a dense copy, every layer of every step; at batch 64 on SmolLM2 that gather and
torch's flash kernel (built for blocks of queries, not the G heads of one token) were ~40% of
a decode step. The kernel reads the pool in place.

The shared object is compiled with `-O3 -march=native -fopenmp -std=gnu11` (the compiler:
`compiler()`) into ~/.cache/fanout/kernels/ (XDG_CACHE_HOME respected), named by a hash of the
source, the flags, the compiler's version and the CPU's flags, so a changed source or a
home shared between machines never loads a stale or foreign build; it is written under a
temporary name and renamed, so concurrent builders do not see half a file. Without a
compiler, or where the build fails, `load()` returns None (logged once) and the torch path
runs instead.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch

log = logging.getLogger("fanout.engine")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_decode.c")
# gnu11, not c11: ISO C mode turns off contracting a * b + c into one FMA.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
MAX_HEAD_FLOATS = 16384  # Hq * D: a row's accumulators live on its thread's stack (64 KiB)

_loaded: dict[str, object] = {}  # "fn": the function, or None once the build failed


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def compiler() -> str | None:
    """$CC, else cc or gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build() -> str | None:
    cc = compiler()
    if not cc:
        log.warning("CPU decode attention: no C compiler (set CC, or install gcc); using torch")
        return None
    with open(SOURCE, "rb") as f:
        src = f.read()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("CPU decode attention: %s --version failed (%s); using torch", cc, e)
        return None
    key = hashlib.sha256(b"\0".join([src, " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    folder = os.path.join(cache, "fanout", "kernels")
    path = os.path.join(folder, f"cpu_decode-{key}.so")
    if os.path.isfile(path):
        return path
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cpu_decode-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, SOURCE, "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        log.warning("CPU decode attention: the build failed (%s); using torch", e)
        return None
    if done.returncode != 0:
        os.unlink(tmp)
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        log.warning("CPU decode attention: the build failed (%s); using torch", last[0])
        return None
    os.replace(tmp, path)
    return path


def load():
    """The kernel as a ctypes function, or None where it cannot be built."""
    if "fn" not in _loaded:
        path = _build()
        fn = None
        if path is not None:
            fn = ctypes.CDLL(path).fanout_decode_attention
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            fn.argtypes = [p, p, p, p, p, i64, p, p, p, i64, i64, i64, i64, ctypes.c_float]
            fn.restype = None
        _loaded["fn"] = fn
    return _loaded["fn"]


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel can take a model of this dtype (it is fp32 only) and these shapes."""
    return (dtype == torch.float32 and num_heads % num_kv_heads == 0
            and num_heads * head_dim <= MAX_HEAD_FLOATS)


def decode_attention(fn, q: torch.Tensor, out: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                     table: torch.Tensor, rows: torch.Tensor, req: torch.Tensor,
                     lens: torch.Tensor, scale: float) -> None:
    """out[rows] = attention of q[rows] over each row's first lens keys (slots table[req]).
    q, out [T, Hq, D] and kc, vc [slots, Hkv, D] contiguous fp32; table, rows, req, lens
    contiguous int64; every slot in range (the caller's invariant: the C code trusts it)."""
    _, Hq, D = q.shape
    fn(q.data_ptr(), out.data_ptr(), kc.data_ptr(), vc.data_ptr(), table.data_ptr(),
       table.stride(0), rows.data_ptr(), req.data_ptr(), lens.data_ptr(), rows.shape[0], Hq,
       kc.shape[1], D, scale)
