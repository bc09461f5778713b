"""Continuous batching: admission, chunked prefill, decode, retraction, abort.

Each step runs every running request that is decoding (one token each) plus as many
prefill tokens as the token budget allows, in one forward pass. A long prompt is split
across steps (chunked prefill). When KV runs out, the most recently admitted requests
are retracted back to the waiting queue; their computed KV goes to the radix cache, so
recomputation later is often a cache hit.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .batch import ScheduleBatch
from .kv_manager import KVManager
from .req import Req, ReqStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_running: int = 256  # requests holding KV at once
    max_prefill_tokens: int = 2048  # new prompt tokens per step (the chunk size)
    # A new request sharing this many uncached tokens with one prefilling now waits a step
    # to reuse that prefix instead of computing it again (in-batch prefix sharing).
    shared_prefix_min: int = 32


@dataclass(slots=True)
class StepResult:
    updated: list  # list[tuple[Req, list[int]]]: requests and the tokens they got this step
    finished: list  # list[Req] finished this step (KV already released)
    prefill_tokens: int = 0
    decode_tokens: int = 0


class Scheduler:
    def __init__(self, runner, kvm: KVManager, sampler, cfg: SchedulerConfig):
        self.runner = runner
        self.kvm = kvm
        self.sampler = sampler
        self.cfg = cfg
        self.max_context = runner.max_context
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.by_rid: dict[str, Req] = {}
        self.num_retractions = 0
        self.prefill_tokens_total = 0  # tokens run through prefill (warm-up savings show here)
        self.decode_tokens_total = 0

    def add(self, req: Req) -> None:
        self.by_rid[req.rid] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, rid: str) -> Req | None:
        """Abort a request wherever it is; its KV is freed now."""
        req = self.by_rid.get(rid)
        if req is None or req.finished:
            return None
        self.finish(req, "abort")
        return req

    def finish(self, req: Req, reason: str, error: str | None = None) -> None:
        req.finish_reason, req.error, req.status = reason, error, ReqStatus.FINISHED
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kvm.release(req)
        self.by_rid.pop(req.rid, None)

    # -- scheduling ---------------------------------------------------------------

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self.kvm.release(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    def _schedule(self) -> ScheduleBatch | None:
        kvm = self.kvm
        reqs, lens, locs = [], [], []
        # 1. Decode every running request that has one token to run; retract if KV is short.
        decodes = [r for r in self.running if r.extend_todo == 1]
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
        candidates = [r for r in self.running if r.extend_todo > 1] + list(self.waiting)
        for r in candidates:
            if budget <= 0:
                break
            new = r.status == ReqStatus.WAITING
            if new:
                if len(self.running) >= self.cfg.max_running or not kvm.admit(r):
                    break
                if self._shares_prefix(r, prefilling):
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
            if new:
                self.waiting.remove(r)
                self.running.append(r)
                r.status = ReqStatus.RUNNING
                if r.num_retractions == 0:
                    r.cached_tokens = r.prefix_len
                reserve += 1
        if not reqs:
            return None
        return ScheduleBatch(reqs, lens, locs)

    def _shares_prefix(self, r: Req, prefilling: list[Req]) -> bool:
        """Does r share a long uncached prefix with a request prefilling in this step? (Decoding
        requests need no check: their prefixes are in the cache already, so admit matched them.)"""
        k = r.prefix_len + self.cfg.shared_prefix_min
        if r.seq_len <= k:
            return False
        head = r.tokens(0, k)
        return any(x.seq_len >= k and x.tokens(0, k) == head for x in prefilling)

    def step(self) -> StepResult:
        batch = self._schedule()
        if batch is None and not self.running:
            self.check()  # idle: every page must be free or cached
        if batch is None:
            if self.waiting and not self.running:
                # Nothing fits even in an empty pool: fail the head instead of spinning.
                r = self.waiting[0]
                self.finish(r, "error", f"request needs more KV than the pool holds "
                                        f"({r.seq_len} tokens)")
                return StepResult([], [r])
            return StepResult([], [])
        fb = batch.to_forward_batch(self.kvm.kv, self.kvm.table, self.runner.device,
                                    group_shared=self.runner.attn.uses_shared_prefixes)
        logits = self.runner.forward(fb)
        result = StepResult([], [])
        sample_reqs, sample_rows, row = [], [], 0
        for i, (r, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            complete = batch.needs_logits(i)
            if n == 1 and r.output_ids:
                result.decode_tokens += 1
            else:
                result.prefill_tokens += n
            if r.return_prompt_logits:
                r.prompt_logits.append(logits[row:row + n].float().cpu())
                row += n
                last = row - 1
            elif complete:
                last = row
                row += 1
            r.kv_len += n
            if n > 1:
                self.kvm.cache_unfinished(r)
            if not complete:
                continue
            if len(r.output_ids) >= r.params.max_new_tokens:
                self.finish(r, "length")  # max_new_tokens == 0: prefill only (warm-up, scoring)
                result.finished.append(r)
                continue
            sample_reqs.append(r)
            sample_rows.append(last)
        self.prefill_tokens_total += result.prefill_tokens
        self.decode_tokens_total += result.decode_tokens
        if sample_reqs:
            out = self.sampler(logits[sample_rows].float(), sample_reqs)
            for j, (r, tok) in enumerate(zip(sample_reqs, out.token_ids)):
                r.output_ids.append(tok)
                if r.params.logprobs:
                    r.output_logprobs.append(out.logprobs[j])
                result.updated.append((r, [tok]))
                reason = self._finish_reason(r, tok)
                if reason:
                    self.finish(r, reason)
                    result.finished.append(r)
        return result

    def _finish_reason(self, r: Req, tok: int) -> str | None:
        p = r.params
        if not p.ignore_eos and tok in r.eos_ids:
            r.matched_stop = tok
            return "stop"
        if tok in p.stop_token_ids:
            r.matched_stop = tok
            return "stop"
        if len(r.output_ids) >= p.max_new_tokens or r.seq_len >= self.max_context:
            return "length"
        return None

    def check(self) -> None:
        """KV invariant; call when idle or between steps."""
        self.kvm.check(self.running)
