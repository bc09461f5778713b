"""The CPU kernels in C (cpu_linear.c, cpu_quant.c, cpu_pointwise.c, cpu_decode.c,
cpu_extend.c, cpu_noise.c, cpu_graph.c): each built once per machine with the C compiler, cached, and loaded with ctypes.

A shared object is compiled with `-O3 -march=native -fopenmp -std=gnu11` (the compiler:
`compiler()`) into ~/.cache/fanout/kernels/ (XDG_CACHE_HOME respected), named by a hash of the
source and the headers beside it (cpu_vector.h), the flags and the CPU's flags, so a changed
source or a home shared between machines never loads a stale or foreign build; it is written
under a temporary name and renamed, so concurrent builders do not see half a file. A build
in the cache is used whether or not a compiler is still there (the key holds nothing of the
compiler: any build of this source for this CPU is the kernel), so a host that built its
kernels once, or an image built with them, runs them without gcc. Where none is cached and
none can be built, `library()` returns None (logged once per kernel, with what it costs) and
the torch path runs instead. Loaded after torch, a library's libgomp.so.1 is torch's: one
OpenMP thread pool.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

log = logging.getLogger("fanout.engine")

FOLDER = os.path.dirname(os.path.abspath(__file__))
# gnu11, not c11: ISO C mode turns off contracting a * b + c into one FMA.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]

_loaded: dict[str, ctypes.CDLL | None] = {}  # name: the library, or None once its build failed
P, I64 = ctypes.c_void_p, ctypes.c_int64  # the kernels' argument types: pointers and sizes


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def compiler() -> str | None:
    """$CC, else cc or gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


# What the torch path costs, said when a kernel cannot be had: SmolLM2-135M on a 2-core
# x86, one request's generation at 102-110 tok/s without the kernels, 347-367 with them.
WITHOUT = "the engine runs at about a third of its CPU speed without the C kernels"


def build(name: str) -> str | None:
    """The path of kernels/NAME.c built (or found in the cache), or None, with a warning."""
    what = f"CPU kernel {name}"
    src = b""
    for file in [f"{name}.c", *sorted(f for f in os.listdir(FOLDER) if f.endswith(".h"))]:
        with open(os.path.join(FOLDER, file), "rb") as f:
            src += f.read()
    key = hashlib.sha256(b"\0".join([src, " ".join(FLAGS).encode(), _cpu_flags().encode()]))
    key = key.hexdigest()[:16]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    folder = os.path.join(cache, "fanout", "kernels")
    path = os.path.join(folder, f"{name}-{key}.so")
    if os.path.isfile(path):
        return path
    cc = compiler()
    if not cc:
        log.warning("%s: no build of it in %s and no C compiler to make one (install gcc, or set "
                    "CC); using torch: %s", what, folder, WITHOUT)
        return None
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, os.path.join(FOLDER, f"{name}.c"), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        log.warning("%s: the build with %s failed (%s); using torch: %s", what, cc, e, WITHOUT)
        return None
    if done.returncode != 0:
        os.unlink(tmp)
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        log.warning("%s: the build with %s failed (%s); using torch: %s", what, cc, last[0], WITHOUT)
        return None
    os.replace(tmp, path)
    return path


# While this thread records a decode forward (cpu_graph.py), `.calls`: every kernel call's
# (Kernel, args). Per thread: another engine's kernels on another thread are not its calls.
recording = threading.local()


class Kernel:
    """A C function with its signature set, called as the ctypes function it wraps; while a
    forward is recorded on this thread, each call is also written down (`recording`)."""
    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        calls = getattr(recording, "calls", None)
        if calls is not None:
            calls.append((self, args))
        return self.fn(*args)


def bind(lib: ctypes.CDLL, name: str, argtypes: list, restype=None) -> Kernel:
    """lib's function NAME with its C signature set."""
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return Kernel(fn)


def functions(name: str, fns: dict, signatures: dict) -> bool:
    """Fill fns, once, with kernels/NAME.c's functions: signatures maps each key to bind()'s
    (C name, argtypes[, restype]). False where the library cannot be built."""
    if not fns:
        lib = library(name)
        if lib is None:
            return False
        fns.update({key: bind(lib, *sig) for key, sig in signatures.items()})
    return True


def head_dim_fits(lib: ctypes.CDLL, head_dim: int) -> bool:
    """Whether an attention kernel of lib takes heads of head_dim floats: a whole number of
    the CPU's vectors (4, 8 or 16 floats), at most MAX_ND of them (cpu_vector.h)."""
    vl = bind(lib, "fanout_vl", [], ctypes.c_int64)()
    return head_dim % vl == 0 and head_dim <= bind(lib, "fanout_max_head_dim", [], ctypes.c_int64)()


def library(name: str) -> ctypes.CDLL | None:
    """kernels/NAME.c as a loaded library, or None where it cannot be built."""
    if name not in _loaded:
        import torch  # noqa: F401  (first: the library then binds torch's libgomp)
        path = build(name)
        _loaded[name] = ctypes.CDLL(path) if path is not None else None
    return _loaded[name]
