"""A worker's ranks under tensor parallel (the split itself: parallel.py). Rank 0 is the
worker's own process and runs the scheduler; ranks 1..N-1 are processes it starts
(`Ranks`), each holding its part of the model and a KV pool of its heads, and running every
forward pass rank 0 runs, in step (`follow`).

Start: rank 0 starts each follower (`python -m worker.engine.ranks FD`: a fresh interpreter,
nothing forked, nothing of the caller's __main__ imported) with a pipe whose first message
is what it runs, and all join one torch.distributed group (gloo on CPUs;
NCCL on GPUs, rank r on cuda:(d + r) where d is the configured device). Each builds its
ModelRunner; the ranks agree on the smallest KV pool any of them can hold; on a GPU, each
captures its CUDA graphs with the others (the collectives are in the graphs).

A step: rank 0's ModelRunner.forward sends the ForwardBatch to every follower as a `Step`
down a pipe (host arrays; pickled), then runs it. A follower rebuilds the ForwardBatch on its
own pools and runs the same forward, whose all-reduces and all-gathers meet rank 0's. Its
logits are dropped. The pipe, not a collective, carries the steps: a follower waits on it
for as long as the worker is idle, with no timeout to run out.

Request-to-token rows: a Step carries a row's slots below its prefix only when they differ
from what the followers were last sent (a new request, a prefix borrowed from the radix
cache); the new tokens' slots are out_cache_loc. Rank 0 keeps a copy of the followers' table
(`Mirror`) to tell.

Ends: rank 0 sends None at close. If rank 0 dies, a follower's pipe reads EOF and it exits.
If a follower dies, rank 0's next send or collective fails (gloo: at once, "Connection
closed by peer"). A forward that raises on one rank ends the group, since the others may
wait in a collective it left, which nothing but the group's timeout (GROUP_TIMEOUT) would
end: a follower whose forward raises exits (code 1); a forward that raises on rank 0 kills
the followers (`Ranks.fail`). Every later forward then raises the cause (the rank that
exited, or rank 0's error), the engine's fault isolation ends in EngineError
(executor.py), and the worker gives its jobs back. Only a rank that hangs, neither
finishing nor exiting, leaves the others to the timeout.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

from multiprocessing.connection import Connection

import numpy as np
import torch
import torch.distributed as dist

from .batch import ForwardBatch, ForwardMode, SharedGroup
from .config import EngineConfig
from .kv_pool import KVPool
from .parallel import TP

log = logging.getLogger("fanout.engine")
GROUP_TIMEOUT = timedelta(minutes=10)  # a collective waiting on a rank that hangs
TENSORS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "prefix_lens",
           "extend_lens", "extend_start_loc", "logits_idx")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the configured GPU's index + r, or the CPU for every rank."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def cpu_threads(size: int) -> int:
    """A CPU rank's share of the cores this process may use."""
    return max(1, len(os.sched_getaffinity(0)) // size)


def join(rank: int, size: int, init: str, device: torch.device) -> TP:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init, rank=rank,
                            world_size=size, timeout=GROUP_TIMEOUT)
    return TP(rank, size, dist.group.WORLD)


@dataclass(slots=True)
class Step:
    """A ForwardBatch as the followers get it: its tensors as host arrays, and the table rows
    to set first ((row, its slots [0, n)))."""
    mode: int
    arrays: dict[str, np.ndarray]
    seq_lens: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    shared: list[SharedGroup] | None
    rows: list[tuple[int, np.ndarray]]

    def write(self, table: torch.Tensor) -> None:
        """Every row's slots [0, seq_len) into a follower's table (or the Mirror), as one
        scatter into the flat table (one copy to a GPU, not one a row)."""
        width = table.stride(0)
        lens = np.asarray(self.extend_lens, dtype=np.int64)
        first = self.arrays["req_pool_indices"] * width + np.asarray(self.prefix_lens, dtype=np.int64)
        within = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
        pos = [np.arange(len(slots), dtype=np.int64) + row * width for row, slots in self.rows]
        pos.append(np.repeat(first, lens) + within)
        val = [slots for _, slots in self.rows] + [self.arrays["out_cache_loc"]]
        table.view(-1)[torch.from_numpy(np.concatenate(pos)).to(table.device)] = \
            torch.from_numpy(np.concatenate(val)).to(table.device)

    def forward_batch(self, kv: KVPool, table: torch.Tensor, device: torch.device) -> ForwardBatch:
        self.write(table)
        t = {k: torch.from_numpy(a).to(device) for k, a in self.arrays.items()}
        return ForwardBatch(mode=ForwardMode(self.mode), seq_lens_cpu=self.seq_lens,
                            prefix_lens_cpu=self.prefix_lens, extend_lens_cpu=self.extend_lens,
                            req_to_token=table, kv=kv, shared=self.shared, **t)


class Mirror:
    """Rank 0's copy of the followers' request-to-token table (the module doc)."""

    def __init__(self, shape: torch.Size):
        self.table = torch.zeros(shape, dtype=torch.int64)

    def step(self, fb: ForwardBatch) -> Step:
        if fb.images is not None or fb.lora is not None:  # refused at load (model_runner.py)
            raise RuntimeError("a batch with images or adapters under tensor parallel")
        arrays = {k: getattr(fb, k).cpu().numpy() for k in TENSORS}
        rows = []
        longest = max(fb.prefix_lens_cpu, default=0)
        if longest:
            idx = arrays["req_pool_indices"]
            have = fb.req_to_token[fb.req_pool_indices, :longest].cpu()
            for i, (row, p) in enumerate(zip(idx.tolist(), fb.prefix_lens_cpu)):
                if p and not torch.equal(have[i, :p], self.table[row, :p]):
                    rows.append((row, have[i, :p].numpy().copy()))
        step = Step(int(fb.mode), arrays, list(fb.seq_lens_cpu), list(fb.prefix_lens_cpu),
                    list(fb.extend_lens_cpu), fb.shared, rows)
        step.write(self.table)
        return step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """Rank 0's handle on its followers: starts them, joins the group with them, sends them
    each step."""

    def __init__(self, model_path: str, cfg: EngineConfig, device: torch.device):
        size = cfg.tensor_parallel_size
        init = f"tcp://127.0.0.1:{free_port()}"
        self.pipes: list[Connection] = []
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, size):
            r, w = os.pipe()
            p = subprocess.Popen([sys.executable, "-m", "worker.engine.ranks", str(r)], pass_fds=(r,))
            os.close(r)
            pipe = Connection(w, readable=False)
            pipe.send_bytes(pickle.dumps((rank, size, init, model_path, cfg)))
            self.pipes.append(pipe)
            self.procs.append(p)
        log.info("tensor parallel: %d ranks (pids %s) joining over %s", size,
                 ", ".join(str(p.pid) for p in self.procs), init)
        self.tp = join(0, size, init, device)
        self.mirror: Mirror | None = None
        self.failed: RuntimeError | None = None  # why the group ended (fail)

    def exited(self, wait: float = 0.0) -> RuntimeError | None:
        """An error naming a follower that has exited (within `wait` seconds), or None. Its
        own error is in this worker's log: the followers share its stderr."""
        deadline = time.monotonic() + wait
        while True:
            for rank, p in enumerate(self.procs, 1):
                if p.poll() is not None:
                    return RuntimeError(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code "
                                        f"{p.returncode}; its error, if any, is in this worker's log")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def fail(self, e: Exception) -> RuntimeError:
        """After rank 0's forward raised e: the group ends (the module doc). The cause is a
        follower that exited (its failed forward, or its death, broke rank 0's collective)
        or else rank 0's own error; the followers are killed, and every later send raises it."""
        if self.failed is None:
            why = self.exited(wait=2.0)
            if why is None:
                why = RuntimeError(f"tensor parallel: rank 0's forward failed ({type(e).__name__}: {e}); "
                                   "the other ranks were stopped (they may wait in a collective it left)")
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            self.failed = why
        return self.failed

    def send(self, fb: ForwardBatch) -> None:
        if self.failed is not None:
            raise self.failed
        if (why := self.exited()) is not None:
            raise why
        if self.mirror is None:
            self.mirror = Mirror(fb.req_to_token.shape)
        data = pickle.dumps(self.mirror.step(fb), protocol=pickle.HIGHEST_PROTOCOL)
        for pipe in self.pipes:
            pipe.send_bytes(data)

    def close(self, failed: bool = False) -> None:
        """Stop the followers (`failed`: kill them, they may be anywhere) and leave the group."""
        data = pickle.dumps(None)
        for pipe, p in zip(self.pipes, self.procs):
            try:
                if not failed:
                    pipe.send_bytes(data)
            except OSError:
                pass  # gone already
            pipe.close()
            try:
                p.wait(0 if failed else 30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        dist.destroy_process_group()


def follow(pipe: Connection) -> None:
    """A follower's life: join, load its part, size its pools with the others', then run each
    step rank 0 sends until it sends None or is gone."""
    from .kv_manager import KVManager  # (model_runner imports this module)
    from .model_runner import ModelRunner, resolve_device
    rank, size, init, model_path, cfg = pickle.loads(pipe.recv_bytes())
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    tp = join(rank, size, init, rank_device(resolve_device(cfg.device), rank))
    runner = ModelRunner(model_path, cfg, tp)
    kvm = KVManager.create(runner.config, runner.kv_tokens_to_allocate(), cfg.page_size, cfg.max_running,
                           False, runner.dtype, runner.device)
    runner.attach_kv(kvm.kv, kvm.rtt)
    while True:
        try:
            step = pickle.loads(pipe.recv_bytes())
        except EOFError:  # rank 0 is gone
            break
        if step is None:
            break
        try:
            runner.forward(step.forward_batch(kvm.kv, kvm.rtt.table, runner.device))
        except Exception:  # rank 0 may wait in a collective this one left: exiting ends it
            log.exception("forward failed; this rank exits")
            logging.shutdown()
            os._exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    follow(Connection(int(sys.argv[1]), writable=False))
