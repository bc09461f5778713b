"""Run and sample one scheduled batch, changing no request: the step's part that can raise.

A batch whose forward or sampler raises is isolated: run again in halves, each on the slots
already allocated to it, down to single requests. A half that runs gets exactly the tokens
the whole batch would have given it (sampling is seeded per (seed, position)); a request
that fails alone caused the fault. Scheduler.process applies the outcome.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .batch import ForwardBatch, ScheduleBatch
from .kv_manager import KVManager
from .model_runner import ModelRunner
from .req import Req
from .sampler import SampleOutput, Sampler, TokenLogprob
from .sampling_params import SamplingParams

log = logging.getLogger("fanout.engine")


class EngineError(RuntimeError):
    """A step failed in a way no request can be blamed for (the device, the model, the
    engine's own bookkeeping): every request in the engine is in doubt."""


@dataclass(slots=True)
class BatchOutput:
    """One forward + sample of a batch, not yet applied to its requests."""
    batch: ScheduleBatch
    prompt_logits: list[torch.Tensor | None]  # per request: its rows, when it asked
    prompt_logprobs: list[list[TokenLogprob]]  # per request: of the prompt tokens this chunk scored
    sampled: list[Req]  # the requests that got a token, in samples' row order
    samples: SampleOutput | None  # None when nothing was sampled


@dataclass(slots=True)
class Prepared:
    """A batch's forward inputs and, per request, what its logits rows are for: fixed when the
    batch is prepared, so a forward on another thread reads no request state (overlap: the
    previous step's fan-in may finish a request of this batch meanwhile)."""
    batch: ScheduleBatch
    fb: ForwardBatch
    complete: list[bool]  # its prompt is all in KV after this step: a row to sample from
    all_logits: list[bool]  # every new token's row is computed (prompt logits or logprobs)
    sample: list[bool]  # it draws a token this step
    scored: list[tuple[int, int, list[int]]]  # prompt logprobs: rows [lo, hi) of its new tokens, their targets


@dataclass(slots=True)
class RunOutput:
    """A step's outcome: the batches (the whole, or its halves) that ran, and the requests
    that failed alone with their exception."""
    outputs: list[BatchOutput] = field(default_factory=list)
    failed: list[tuple[Req, Exception]] = field(default_factory=list)


class Executor:
    def __init__(self, runner: ModelRunner, sampler: Sampler, kvm: KVManager):
        self.runner = runner
        self.sampler = sampler
        self.kvm = kvm
        self.failed_steps = 0  # steps whose forward raised (isolated, or an EngineError)

    def run(self, batch: ScheduleBatch) -> RunOutput:
        try:  # free until something raises
            return RunOutput([self.forward(self.prepare(batch))])
        except Exception as e:
            exc = e  # isolated outside this handler, so later faults are not chained to it
        return self._isolate(batch, exc)

    def recover(self, batch: ScheduleBatch, exc: Exception) -> RunOutput:
        """After a forward that raised while the previous step's fan-in ran beside it (overlap):
        isolate the cause among the batch's requests still running (a request that fan-in
        finished meanwhile has its KV released and needs no token)."""
        live = [i for i, r in enumerate(batch.reqs) if not r.finished]
        if not live:
            return RunOutput()
        return self._isolate(batch.subset(live, self.kvm.table), exc)

    def prepare(self, batch: ScheduleBatch) -> Prepared:
        """The forward's inputs and the rows' plan, from the requests' state now."""
        fb = batch.to_forward_batch(self.kvm.kv, self.kvm.table, self.runner.device,
                                    group_shared=self.runner.attn.uses_shared_prefixes)
        complete = [batch.needs_logits(i) for i in range(len(batch.reqs))]
        # max_new_tokens == 0: prefill only (warm-up, scoring), nothing to sample.
        sample = [c and len(r.output_ids) < r.params.max_new_tokens
                  for r, c in zip(batch.reqs, complete)]
        scored = [self._scored(r, n) if r.prompt_logprobs_todo else (0, 0, [])
                  for r, n in zip(batch.reqs, batch.extend_lens)]
        return Prepared(batch, fb, complete, [r.all_logits for r in batch.reqs], sample, scored)

    def forward(self, p: Prepared) -> BatchOutput:
        """Forward and sample. Changes no request, so a failed batch can run again."""
        batch = p.batch
        logits = self.runner.forward(p.fb)
        prompt: list[torch.Tensor | None] = []
        prompt_lps: list[list[TokenLogprob]] = []
        sample_reqs, sample_rows, row = [], [], 0
        for i, (r, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            prompt.append(logits[row:row + n].float().cpu() if r.return_prompt_logits else None)
            lo, hi, targets = p.scored[i]
            prompt_lps.append(self.sampler.prompt_logprobs(logits[row + lo:row + hi], targets,
                                                           r.params.prompt_logprobs) if hi > lo else [])
            if p.all_logits[i]:
                row += n
                last = row - 1
            elif p.complete[i]:
                last = row
                row += 1
            if p.sample[i]:
                sample_reqs.append(r)
                sample_rows.append(last)
        out = None
        if sample_reqs:
            # All rows in order (they only grow) are not copied, unless prompt logits kept above
            # are views of them: a grammar's mask is applied to the sampler's input in place.
            whole = sample_rows[-1] == len(sample_rows) - 1 == logits.shape[0] - 1 \
                and all(t is None for t in prompt)
            out = self.sampler((logits if whole else logits[sample_rows]).float(), sample_reqs)
        return BatchOutput(batch, prompt, prompt_lps, sample_reqs, out)

    @staticmethod
    def _scored(r: Req, n: int) -> tuple[int, int, list[int]]:
        """The rows [lo, hi) of r's n new tokens whose logits score a prompt token, and those
        tokens: position p's row scores prompt token p + 1, for the positions past those r
        has (a chunk recomputed after a retraction) and before the prompt's last (whose row
        samples the first token)."""
        have, end = len(r.prompt_logprobs), len(r.input_ids) - 1
        lo, hi = max(r.kv_len, have), min(r.kv_len + n, end)
        if hi <= lo:
            return 0, 0, []
        return lo - r.kv_len, hi - r.kv_len, r.input_ids[lo + 1:hi + 1]

    def _isolate(self, batch: ScheduleBatch, exc: Exception) -> RunOutput:
        """Bisect a failed batch (see the module doc). If every request fails alone and a
        probe step fails too, the fault is the engine's: the step is undone (its slots
        freed) and EngineError raised."""
        log.warning("engine step of %d requests failed (%s: %s); isolating the cause",
                    len(batch.reqs), type(exc).__name__, exc)
        self.failed_steps += 1
        result = RunOutput()
        todo = [(batch, exc)]
        while todo:
            part, e = todo.pop()
            if len(part.reqs) == 1:
                result.failed.append((part.reqs[0], e))
                continue
            for half in part.halves(self.kvm.table):
                try:
                    result.outputs.append(self.forward(self.prepare(half)))
                except Exception as e2:
                    todo.append((half, e2))
        if len(result.failed) == len(batch.reqs) and not self._healthy():
            for r, _ in result.failed:
                self.kvm.rollback(r)
            raise EngineError(f"engine step failed for each request alone, and for a probe "
                              f"too: {type(exc).__name__}: {exc}") from exc
        return result

    def _healthy(self) -> bool:
        """Can the engine run a step at all? One token of a plain request through the same
        forward and sampler, on the scratch row and page (which no request owns)."""
        probe = Req(rid="probe", input_ids=[0], params=SamplingParams(max_new_tokens=1), seed=0,
                    req_pool_idx=self.kvm.rtt.scratch_row)
        try:
            self.forward(self.prepare(ScheduleBatch([probe], [1], [torch.zeros(1, dtype=torch.int64)])))
        except Exception:
            log.exception("probe step failed too")
            return False
        return True
