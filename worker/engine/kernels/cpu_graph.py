"""A decode forward on a CPU recorded once and replayed in one C call (cpu_graph.c): the CPU's
counterpart of a CUDA graph (cuda_graph.py runs both).

Why: on a CPU in fp32 a decode step's forward is C kernels only, ~8 a layer (add + norm, the
matmuls, RoPE + the K/V store, attention), but each is reached through Python: the module's
call, the wrapper's checks and allocation, ctypes' conversion of a dozen arguments. With the
weights' codes kept (a small step's kernels are fast) that was about a third of a batch-1 step
on SmolLM2 (~240 calls). A recording is the list of those calls with their arguments: pointers
into tensors that stay alive with it (its intermediates, its inputs and output; the weights and
the KV pools, which the runner holds). A replay runs the same kernels on the same memory, with
no Python between them; the caller writes the step's inputs into the recording's own input
tensors first.

Only C kernel calls, allocations and views may run while recording: any other torch op would
compute in torch, which a replay skips, and a host read (`.item()`) would bake one step's
value into every replay. Recording refuses both (NotRecordable, naming the op); the caller then
runs eagerly. Invariant, checked: every call recorded returns nothing, takes at most MAX_INTS
integer or pointer arguments and MAX_FLOATS floats (cpu_graph.c calls all through one prototype,
valid on x86-64 and AArch64 Linux only: `supported()`).
"""
from __future__ import annotations

import ctypes
import platform
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import cpu_build

aten = torch.ops.aten
# The allocations a kernel's wrapper makes for its output (torch.empty, empty_like): kept alive
# with the recording, since its calls point into them.
_ALLOCS = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default}
_fns: dict[str, object] = {}


class NotRecordable(RuntimeError):
    """The forward does something a replay would not repeat (the message says what)."""


def supported() -> bool:
    """Whether recordings can run here: cpu_graph.c's calling convention holds (x86-64 or
    AArch64 Linux) and it builds."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        return False
    return cpu_build.functions("cpu_graph", _fns, {
        "replay": ("fanout_replay", [ctypes.c_void_p, ctypes.c_int64]),
        "replay_timed": ("fanout_replay_timed", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]),
        "max_ints": ("fanout_replay_max_ints", [], ctypes.c_int64),
        "max_floats": ("fanout_replay_max_floats", [], ctypes.c_int64)})


ALIGN = 64  # bytes: each allocation in an arena starts on a cache line


def _span(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to past its last."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


class Arena:
    """One block that several recordings allocate from, each from its start (`take` after
    `reset`): a replay's intermediates are dead once it returns, so recordings that never
    replay at once (one runner's batch sizes) share them, as CUDA graphs share a pool. A
    replay's outputs are then valid until the next replay of any of them."""

    def __init__(self, nbytes: int):
        self.buf = torch.empty(nbytes, dtype=torch.uint8)
        self.top = 0

    def reset(self) -> None:
        self.top = 0

    def take(self, like: torch.Tensor) -> torch.Tensor | None:
        """A tensor of like's shape, strides and dtype in the arena's next bytes; None where
        they do not fit."""
        n = _span(like)
        if self.top + n > self.buf.numel():
            return None
        out = self.buf[self.top:self.top + n].view(like.dtype).as_strided(like.shape, like.stride())
        self.top += -(-n // ALIGN) * ALIGN
        return out


class _KernelsOnly(TorchDispatchMode):
    """Lets views and allocations through, raises on any other torch op. An allocation comes
    from the arena, where one is given and it fits, else from torch, and is then kept."""

    def __init__(self, arena: Arena | None):
        super().__init__()
        self.arena = arena
        self.kept: list[torch.Tensor] = []
        self.used = 0  # bytes the allocations took, each rounded up to ALIGN

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func in _ALLOCS):
            raise NotRecordable(f"{func} runs in torch, not in a C kernel")
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCS:
            self.used += -(-_span(out) // ALIGN) * ALIGN
            placed = self.arena.take(out) if self.arena is not None else None
            if placed is None:
                self.kept.append(out)
            out = placed if placed is not None else out
        return out


@dataclass
class Recording:
    calls: ctypes.Array  # of cpu_graph.c's fanout_call, in order
    kept: list[torch.Tensor]  # allocations outside its arena, which its calls point into
    arena: Arena | None  # the rest of its allocations
    used: int  # bytes its allocations take (an arena to hold them all needs this many)
    out: Any  # what the recorded function returned (its tensors rewritten by each replay)
    kernels: list[str]  # each call's C function, in order

    def replay(self) -> None:
        _fns["replay"](ctypes.addressof(self.calls), len(self.calls))

    def replay_timed(self, seconds: ctypes.Array) -> None:
        """A replay that adds each call's wall seconds to seconds[c]: a ctypes array of
        len(calls) doubles."""
        if not isinstance(seconds, ctypes.Array) or seconds._type_ is not ctypes.c_double \
                or len(seconds) < len(self.calls):
            raise ValueError(f"replay_timed: seconds must be a ctypes array of {len(self.calls)} doubles")
        _fns["replay_timed"](ctypes.addressof(self.calls), len(self.calls), ctypes.addressof(seconds))

    @property
    def nbytes(self) -> int:
        """Its own memory, outside its arena."""
        return sum(_span(t) for t in self.kept)


def record(fn: Callable[[], Any], arena: Arena | None = None) -> Recording:
    """Run fn() once (its kernels run), recording its kernel calls, its allocations placed in
    `arena` from its start (reset) where they fit; NotRecordable where it runs anything else,
    or where recordings cannot run here."""
    if not supported():
        raise NotRecordable("no replay kernel here (it needs x86-64 or AArch64 Linux and a C compiler)")
    max_ints, max_floats = _fns["max_ints"](), _fns["max_floats"]()

    class Call(ctypes.Structure):
        _fields_ = [("fn", ctypes.c_void_p), ("i", ctypes.c_int64 * max_ints),
                    ("f", ctypes.c_float * max_floats)]

    if arena is not None:
        arena.reset()
    mode, calls = _KernelsOnly(arena), []
    cpu_build.recording.calls = calls
    try:
        with mode:
            out = fn()
    finally:
        cpu_build.recording.calls = None
    array = (Call * len(calls))()
    for slot, (kernel, args) in zip(array, calls):
        fn_, ints, floats = kernel.fn, [], []
        if fn_.restype is not None:
            raise NotRecordable(f"{fn_.__name__} returns a value, which a replay would drop")
        for kind, a in zip(fn_.argtypes, args):
            if kind is ctypes.c_float:
                floats.append(float(a))
            elif kind in (ctypes.c_void_p, ctypes.c_int64):
                ints.append(int(a or 0))
            else:
                raise NotRecordable(f"{fn_.__name__} takes a {kind.__name__}, which cpu_graph.c cannot pass")
        if len(ints) > max_ints or len(floats) > max_floats:
            raise NotRecordable(f"{fn_.__name__} takes {len(ints)} integer and {len(floats)} float "
                                f"arguments; cpu_graph.c passes {max_ints} and {max_floats}")
        slot.fn = ctypes.cast(fn_, ctypes.c_void_p).value
        slot.i[:len(ints)], slot.f[:len(floats)] = ints, floats
    return Recording(array, mode.kept, arena, mode.used, out, [k.fn.__name__ for k, _ in calls])
