"""Continuous batching: admission, chunked prefill, decode, retraction, abort; and the one
place a request finishes.

Each step runs every running request that is decoding (one token each) plus as many
prefill tokens as the token budget allows, in one forward pass. A long prompt is split
across steps (chunked prefill). When KV runs out, the most recently admitted requests
are retracted back to the waiting queue; their computed KV goes to the radix cache, so
recomputation later is often a cache hit.

Fair shares: requests have an owner (a worker's is the job). When the slots are full and
an owner holding fewer than its share (max_running / owners with requests here) waits,
the newest requests of owners over their share are retracted to make room, and waiting
requests of owners under their share are admitted first. So a small job joins at once
beside a huge one whose long samples fill the engine, instead of waiting for one of them
to end. A retracted request resumes where it was (its tokens are kept, its KV is usually
still cached, its draws depend on (seed, step) only: sampler.py), so outputs do not change.
Shares count slots; a pool short of KV pages still retracts the newest requests, whoever
owns them.

Step shares: slots alone leave a small job's every step as long as a huge one's (256
decode rows of long samples cost 20-40x a step of 4 on a CPU). So when several owners have
work, a step runs at most max(step_share, the least busy owner's) requests of each owner;
an owner's other requests sit the step out, keeping their KV, and take turns (those that
ran least recently go first). Prefill goes to the least busy owners first. A small job's
steps then cost about twice what they would alone; two huge jobs (each with more requests
than the step share) are not limited at all.

A step is schedule() -> Executor.run -> process(): process applies what the batch produced
(KV lengths, tokens) and decides which requests are done. Every request ends in finish(),
whoever decides it (a token, the front's stop strings, a fault, an abort), and
take_finished() hands the step's finished requests to the front.
"""
from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass

from .batch import ScheduleBatch
from .config import EngineConfig
from .executor import BatchOutput, RunOutput
from .kv_manager import KVManager
from .req import Req, ReqStatus

log = logging.getLogger("fanout.engine")

# A new request sharing this many uncached tokens with one prefilling now waits a step to
# reuse that prefix instead of computing it again (in-batch prefix sharing).
SHARED_PREFIX_MIN = 32
# A worker whose engine is full takes a new job's shard only while each owner would keep
# at least this many slots.
MIN_SHARE = 8
# step_share's default by device type: a GPU's step costs about the same for 8 requests as
# for 64, a CPU's grows with every one.
STEP_SHARE = {"cpu": 8, "cuda": 64}


def step_error(exc: BaseException) -> str:
    """The error a request gets when it makes a step fail on its own."""
    return f"internal error in engine step: {type(exc).__name__}: {exc}"


@dataclass(slots=True)
class StepResult:
    tokens: list[tuple[Req, int]]  # the token each request got this step
    finished: list[Req]  # requests finished since the last step (KV already released)


class Scheduler:
    def __init__(self, cfg: EngineConfig, kvm: KVManager, max_context: int, device_type: str = "cpu"):
        self.cfg = cfg
        self.step_share = cfg.step_share if cfg.step_share is not None else STEP_SHARE.get(device_type, 8)
        self.steps = 0  # steps scheduled (a request's ran_at is one of them)
        self.kvm = kvm
        self.max_context = max_context
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.by_rid: dict[str, Req] = {}
        self.owners: Counter = Counter()  # owner -> its unfinished requests here
        self._finished: list[Req] = []
        self.num_retractions = 0
        self.starved: Counter = Counter()  # owner -> its waiting requests within its share
        self.prefill_tokens_total = 0  # tokens run through prefill (warm-up savings show here)
        self.decode_tokens_total = 0
        self.dropped_tokens = 0  # sampled for requests that ended while their step ran (overlap)

    def add(self, req: Req) -> None:
        self.by_rid[req.rid] = req
        self.owners[req.owner] += 1
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_room(self, pending: int = 0) -> bool:
        """Worth taking more requests now: every request taken so far runs (none waits, and
        none of `pending` is on its way) and slots are free. A worker takes a job's next
        shard only then, so the shards of one job spread over the workers that have room
        instead of queuing behind one of them."""
        return not self.waiting and pending == 0 and len(self.running) < self.cfg.max_running

    def has_room_for_owner(self, pending: int = 0) -> bool:
        """Worth taking requests of an owner that has none here, although has_room() is
        false: they would get a share of at least MIN_SHARE slots, and no owner waits for
        its share already (nothing is on its way either)."""
        owners = {r.owner for r in self.running} | {r.owner for r in self.waiting}
        return (pending == 0 and not self.starved
                and self.cfg.max_running // (len(owners) + 1) >= MIN_SHARE)

    def abort(self, rid: str) -> Req | None:
        """Abort a request wherever it is; its KV is freed now."""
        req = self.by_rid.get(rid)
        if req is None or req.finished:
            return None
        self.finish(req, "abort")
        return req

    def finish(self, req: Req, reason: str, error: str | None = None,
               matched_stop: str | int | None = None) -> None:
        """The one place a request ends: it leaves the queues and its KV is released. Also
        for requests that never reached the queues (refused by the front). A request already
        finished (its final event failed in fan-in) only has its reason replaced."""
        first = not req.finished
        req.finish_reason, req.error, req.matched_stop = reason, error, matched_stop
        req.status = ReqStatus.FINISHED
        if not first:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kvm.release(req)
        if self.by_rid.pop(req.rid, None) is not None:
            self.owners[req.owner] -= 1
            if not self.owners[req.owner]:
                del self.owners[req.owner]
        self._finished.append(req)

    def take_finished(self) -> list[Req]:
        """The requests finished since the last call."""
        out, self._finished = self._finished, []
        return out

    # -- scheduling ---------------------------------------------------------------

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self.kvm.release(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> ScheduleBatch | None:
        """The next step's batch, its slots allocated; None when nothing can run."""
        batch = self._build()
        if batch is None and not self.running:
            self.check()  # idle: every page must be free or cached
            if self.waiting:
                # Nothing fits even in an empty pool: fail the head instead of spinning.
                r = self.waiting[0]
                self.finish(r, "error", f"request needs more KV than the pool holds "
                                        f"({r.seq_len} tokens)")
        return batch

    def _rebalance(self) -> list[Req]:
        """Fair shares (module docstring): retract what the owners waiting within their
        share need beyond the free slots, newest first, from owners over their share.
        Returns the waiting queue in admission order: those within their share first."""
        self.starved = Counter()
        if not self.waiting:
            return []
        held = Counter(r.owner for r in self.running)
        owners = set(held) | {r.owner for r in self.waiting}
        if len(owners) < 2:
            return list(self.waiting)
        share = max(1, self.cfg.max_running // len(owners))
        first, rest = [], []
        for r in self.waiting:
            if held[r.owner] + self.starved[r.owner] < share:
                self.starved[r.owner] += 1
                first.append(r)
            else:
                rest.append(r)
        need = len(first) - (self.cfg.max_running - len(self.running))
        for victim in reversed(self.running[:]):
            if need <= 0:
                break
            if held[victim.owner] > share:
                self._retract(victim)
                held[victim.owner] -= 1
                rest.insert(0, victim)
                need -= 1
        return first + rest

    def _share(self, want: Counter) -> int | None:
        """The requests each owner may run this step, given how many each has that could
        run (module docstring, "Step shares"); None when fewer than two owners have any."""
        if len(want) < 2:
            return None
        return max(self.step_share, min(want.values()))

    def _build(self) -> ScheduleBatch | None:
        kvm = self.kvm
        reqs, lens, locs = [], [], []
        waiting = self._rebalance()
        self.steps += 1
        # 1. Decode every running request that has one token to run, within its owner's
        # share; retract if KV is short.
        decodes, candidates = [], []  # then the prefill candidates: chunked ones, then waiting
        for r in self.running:
            todo = r.extend_todo
            if todo == 1:
                decodes.append(r)
            elif todo > 1:
                candidates.append(r)
        candidates += waiting
        share = None
        if self.step_share and len(self.owners) > 1:  # one owner (the usual case): no counting
            want = Counter(r.owner for r in decodes) + Counter(r.owner for r in candidates)
            share = self._share(want)
        used: Counter = Counter()
        if share is not None:
            candidates.sort(key=lambda r: want[r.owner])  # the least busy owners' prefill first
            turn = set()
            for r in sorted(decodes, key=lambda r: r.ran_at):
                if used[r.owner] < share:
                    used[r.owner] += 1
                    turn.add(r)
            decodes = [r for r in decodes if r in turn]
        while decodes and sum(kvm.pages_for(r, 1) for r in decodes) > kvm.available_pages:
            victim = self.running[-1]
            self._retract(victim)
            if victim in decodes:
                decodes.remove(victim)
        if decodes:
            locs.append(kvm.alloc_decode(decodes))
            reqs.extend(decodes)
            lens.extend([1] * len(decodes))
        prefilling: list[Req] = []
        # 2. Prefill: continue chunked requests, then admit waiting ones, within the budget.
        budget = self.cfg.max_prefill_tokens
        # Keep a page per running request free so the next decode step rarely retracts.
        reserve = len(self.running)
        for r in candidates:
            if budget <= 0:
                break
            if share is not None and used[r.owner] >= share:
                continue
            new = r.status == ReqStatus.WAITING
            if new:
                if len(self.running) >= self.cfg.max_running or not kvm.admit(r):
                    break
                if not r.prompt_logprobs_todo and self._shares_prefix(r, prefilling):
                    kvm.release(r)  # wait one step and take the prefix from the cache
                    continue
            n = min(r.extend_todo, budget)
            if kvm.pages_for(r, n) + reserve > kvm.available_pages:
                # Not even a smaller chunk? Take what fits, else wait.
                fit = (kvm.available_pages - reserve) * kvm.ps + (-r.alloc_len % kvm.ps)
                n = min(n, fit)
                if n <= 0:
                    if new:
                        kvm.release(r)
                    break
            locs.append(kvm.alloc_extend(r, n))
            reqs.append(r)
            lens.append(n)
            prefilling.append(r)
            budget -= n
            used[r.owner] += 1
            if new:
                self.waiting.remove(r)
                self.running.append(r)
                r.status = ReqStatus.RUNNING
                if r.num_retractions == 0:
                    r.cached_tokens = r.prefix_len
                reserve += 1
        if not reqs:
            return None
        for r in reqs:
            r.ran_at = self.steps
        return ScheduleBatch(reqs, lens, locs)

    def _shares_prefix(self, r: Req, prefilling: list[Req]) -> bool:
        """Does r share a long uncached prefix with a request prefilling in this step? (Decoding
        requests need no check: their prefixes are in the cache already, so admit matched them.)"""
        k = r.prefix_len + SHARED_PREFIX_MIN
        if r.seq_len <= k:
            return False
        head = r.tokens(0, k)
        return any(x.seq_len >= k and x.tokens(0, k) == head for x in prefilling)

    # -- results ------------------------------------------------------------------

    def process(self, run: RunOutput) -> StepResult:
        """Apply a step's outcome to its requests, and end those that are done."""
        tokens: list[tuple[Req, int]] = []
        for out in run.outputs:
            self._commit(out, tokens)
        for r, e in run.failed:
            if r.finished:  # ended by the fan-in that ran beside this step (overlap)
                continue
            log.error("request %s failed alone in an engine step; it ends with an error",
                      r.rid, exc_info=e)
            self.finish(r, "error", step_error(e))
        return StepResult(tokens, self.take_finished())

    def _commit(self, out: BatchOutput, tokens: list[tuple[Req, int]]) -> None:
        """KV lengths, prompt logits and sampled tokens of one batch; finishes. A request
        that ended while the batch ran (overlap: a stop string found by the previous step's
        fan-in, its KV released then) takes nothing from it."""
        batch = out.batch
        for i, (r, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            if r.finished:
                continue
            if n == 1 and r.output_ids:
                self.decode_tokens_total += 1
            else:
                self.prefill_tokens_total += n
            if out.prompt_logits[i] is not None:
                r.prompt_logits.append(out.prompt_logits[i])
            if out.prompt_logprobs[i]:
                r.prompt_logprobs.extend(out.prompt_logprobs[i])
            complete = batch.needs_logits(i)  # before kv_len moves on
            r.kv_len += n
            if n > 1:
                self.kvm.cache_unfinished(r)
            if complete and len(r.output_ids) >= r.params.max_new_tokens:
                self.finish(r, "length")  # prefill only: nothing to sample
        for j, r in enumerate(out.sampled):
            if r.finished:
                self.dropped_tokens += 1
                continue
            tok = out.samples.token_ids[j]
            r.output_ids.append(tok)
            if r.params.logprobs:
                r.output_logprobs.append(out.samples.logprobs[j])
            tokens.append((r, tok))
            if r.grammar is not None and not r.grammar.accept(tok):
                # The sampler drew from the grammar's mask: only a mask that allowed nothing
                # (a grammar this vocabulary cannot spell) gets here.
                self.finish(r, "error", f"the grammar does not allow token {tok} here")
                continue
            self._finish_after(r, tok)

    def _finish_after(self, r: Req, tok: int) -> None:
        """End r if its new token tok completes it: a stop token, a finished grammar, or
        the length limit."""
        p = r.params
        if (not p.ignore_eos and tok in r.eos_ids) or tok in p.stop_token_ids:
            self.finish(r, "stop", matched_stop=tok)
        elif r.grammar is not None and r.grammar.done:  # complete, whatever ignore_eos says
            self.finish(r, "stop", matched_stop=tok if tok in r.eos_ids else None)
        elif len(r.output_ids) >= p.max_new_tokens or r.seq_len >= self.max_context:
            self.finish(r, "length")

    def check(self) -> None:
        """KV invariant; call when idle or between steps."""
        self.kvm.check(self.running)
