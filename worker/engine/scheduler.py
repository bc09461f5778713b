"""Continuous batching: admission, chunked prefill, decode, retraction, abort.

Each step runs every running request that is decoding (one token each) plus as many
prefill tokens as the token budget allows, in one forward pass. A long prompt is split
across steps (chunked prefill). When KV runs out, the most recently admitted requests
are retracted back to the waiting queue; their computed KV goes to the radix cache, so
recomputation later is often a cache hit.

A step that raises is isolated (see `_isolate`): the requests that caused it end with
finish_reason "error"; the rest of the batch gets the tokens it would have got.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

from .batch import ScheduleBatch
from .kv_manager import KVManager
from .req import Req, ReqStatus
from .sampling_params import SamplingParams

log = logging.getLogger("fanout.engine")


class EngineError(RuntimeError):
    """A step failed in a way no request can be blamed for (the device, the model, the
    engine's own bookkeeping): every request in the engine is in doubt."""


def step_error(exc: BaseException) -> str:
    """The error a request gets when it makes a step fail on its own."""
    return f"internal error in engine step: {type(exc).__name__}: {exc}"


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
        self.failed_steps = 0  # steps whose forward raised (isolated, or an EngineError)

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
        result = StepResult([], [])
        try:  # free until something raises
            out = self._forward(batch)
        except Exception as e:
            out = e  # isolated below, outside this handler, so later faults are not chained to it
        if isinstance(out, Exception):
            self._isolate(batch, out, result)
        else:
            self._commit(batch, out, result)
        self.prefill_tokens_total += result.prefill_tokens
        self.decode_tokens_total += result.decode_tokens
        return result

    def _forward(self, batch: ScheduleBatch):
        """Forward and sample, changing no request: what can raise runs here, so a failed
        batch can run again. Returns (prompt logits per request or None, sampled requests,
        SampleOutput or None)."""
        fb = batch.to_forward_batch(self.kvm.kv, self.kvm.table, self.runner.device,
                                    group_shared=self.runner.attn.uses_shared_prefixes)
        logits = self.runner.forward(fb)
        prompt, sample_reqs, sample_rows, row = [], [], [], 0
        for i, (r, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            complete = batch.needs_logits(i)
            prompt.append(None)
            if r.return_prompt_logits:
                prompt[-1] = logits[row:row + n].float().cpu()
                row += n
                last = row - 1
            elif complete:
                last = row
                row += 1
            # max_new_tokens == 0: prefill only (warm-up, scoring), nothing to sample.
            if complete and len(r.output_ids) < r.params.max_new_tokens:
                sample_reqs.append(r)
                sample_rows.append(last)
        out = self.sampler(logits[sample_rows].float(), sample_reqs) if sample_reqs else None
        return prompt, sample_reqs, out

    def _commit(self, batch: ScheduleBatch, forward_out, result: StepResult) -> None:
        """Apply a forward's outcome to its requests: KV length, tokens, finishes."""
        prompt, sample_reqs, out = forward_out
        for i, (r, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            if n == 1 and r.output_ids:
                result.decode_tokens += 1
            else:
                result.prefill_tokens += n
            if prompt[i] is not None:
                r.prompt_logits.append(prompt[i])
            complete = batch.needs_logits(i)
            r.kv_len += n
            if n > 1:
                self.kvm.cache_unfinished(r)
            if complete and len(r.output_ids) >= r.params.max_new_tokens:
                self.finish(r, "length")
                result.finished.append(r)
        for j, r in enumerate(sample_reqs):
            tok = out.token_ids[j]
            r.output_ids.append(tok)
            if r.params.logprobs:
                r.output_logprobs.append(out.logprobs[j])
            result.updated.append((r, [tok]))
            if r.grammar is not None and not r.grammar.accept(tok):
                # The sampler drew from the grammar's mask: only a mask that allowed nothing
                # (a grammar this vocabulary cannot spell) gets here.
                self.finish(r, "error", f"the grammar does not allow token {tok} here")
                result.finished.append(r)
                continue
            reason = self._finish_reason(r, tok)
            if reason:
                self.finish(r, reason)
                result.finished.append(r)

    def _isolate(self, batch: ScheduleBatch, exc: Exception, result: StepResult) -> None:
        """The step's forward raised. Run its requests again in halves, each half a step of
        its own on the slots already allocated to it, down to single requests. A half that
        runs gets exactly the tokens the whole step would have given it (sampling is seeded
        per (seed, position)); a request that fails alone caused the fault and ends with an
        error. If every request fails alone and a probe step fails too, the fault is the
        engine's: the step is undone (its slots freed) and EngineError raised."""
        log.warning("engine step of %d requests failed (%s: %s); isolating the cause",
                    len(batch.reqs), type(exc).__name__, exc)
        self.failed_steps += 1
        failed: list[tuple[Req, Exception]] = []
        todo = [(batch, exc)]
        while todo:
            part, e = todo.pop()
            if len(part.reqs) == 1:
                failed.append((part.reqs[0], e))
                continue
            for half in part.halves(self.kvm.table):
                try:
                    out = self._forward(half)
                except Exception as e2:
                    todo.append((half, e2))
                else:
                    self._commit(half, out, result)
        if len(failed) == len(batch.reqs) and not self._healthy():
            for r, _ in failed:
                self.kvm.rollback(r)
            raise EngineError(f"engine step failed for each request alone, and for a probe "
                              f"too: {type(exc).__name__}: {exc}") from exc
        for r, e in failed:
            log.error("request %s failed alone in an engine step; it ends with an error",
                      r.rid, exc_info=e)
            self.finish(r, "error", step_error(e))
            result.finished.append(r)

    def _healthy(self) -> bool:
        """Can the engine run a step at all? One token of a plain request through the same
        forward and sampler, on the scratch row and page (which no request owns)."""
        probe = Req(rid="probe", input_ids=[0], params=SamplingParams(max_new_tokens=1), seed=0,
                    req_pool_idx=self.runner.scratch_row)
        try:
            self._forward(ScheduleBatch([probe], [1], [torch.zeros(1, dtype=torch.int64)]))
        except Exception:
            log.exception("probe step failed too")
            return False
        return True

    def _finish_reason(self, r: Req, tok: int) -> str | None:
        p = r.params
        if not p.ignore_eos and tok in r.eos_ids:
            r.matched_stop = tok
            return "stop"
        if tok in p.stop_token_ids:
            r.matched_stop = tok
            return "stop"
        if r.grammar is not None and r.grammar.done:  # complete, whatever ignore_eos says
            r.matched_stop = tok if tok in r.eos_ids else None
            return "stop"
        if len(r.output_ids) >= p.max_new_tokens or r.seq_len >= self.max_context:
            return "length"
        return None

    def check(self) -> None:
        """KV invariant; call when idle or between steps."""
        self.kvm.check(self.running)
