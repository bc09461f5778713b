"""The engine: model runner + scheduler + fan-out/fan-in front, driven step by step.

The worker drives it with add / step / abort; `generate` is the offline call built on
the same steps.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import torch

from .events import Event, ItemResult, SampleResult
from .front import Front
from .kv_manager import KVManager
from .model_runner import ModelRunner
from .models.loader import load_tokenizer, resolve_dtype
from .radix_cache import RadixCache
from .req import Req
from .sampler import Sampler
from .sampling_params import SamplingParams, per_item
from .scheduler import EngineError, Scheduler, SchedulerConfig

log = logging.getLogger("fanout.engine")

class Engine:
    def __init__(self, model: str, device: str = "cpu", dtype: str | torch.dtype | None = None,
                 page_size: int = 16, kv_tokens: int | None = None,
                 kv_memory_fraction: float = 0.85, max_running: int = 256,
                 max_prefill_tokens: int = 2048, enable_prefix_cache: bool = True,
                 attention_backend: str = "auto", cuda_graph: bool = True,
                 cuda_graph_max_bs: int | None = None,
                 cuda_graph_batch_sizes: list[int] | None = None):
        dev = torch.device(device)
        # fp32 on a CPU (fast matmuls, exact tests), bf16 on a GPU, unless asked.
        dtype = resolve_dtype(dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
        if page_size < 1:
            raise ValueError("page_size: must be >= 1")
        self.tokenizer = load_tokenizer(model)
        self.runner = ModelRunner(model, dev, dtype, page_size, kv_tokens, kv_memory_fraction,
                                  max_running, attention_backend, max_prefill_tokens,
                                  cuda_graph, cuda_graph_max_bs, cuda_graph_batch_sizes)
        cfg = self.runner.config
        self.max_context = cfg.max_context
        self.kv_manager = KVManager(self.runner.kv, self.runner.req_to_token,
                                    RadixCache(self.runner.kv.allocator, enable_prefix_cache))
        self.scheduler = Scheduler(self.runner, self.kv_manager, Sampler(cfg.vocab_size, dev),
                                   SchedulerConfig(max_running, max_prefill_tokens))
        eos = set(cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.front = Front(self.scheduler, self.tokenizer, self.max_context,
                           self.runner.kv_tokens, eos, cfg.vocab_size)

    # -- step-level interface (the worker drives these) --------------------------

    def add(self, tag: Any, items: list[tuple], sampling_params, seed: int | None = None,
            sink: Callable[[Event], None] | None = None) -> int:
        """Queue items (index, prompt or None, input_ids or None) under tag. Their events go
        to sink, or are returned by step() when no sink is given. Returns the job seed."""
        return self.front.add(tag, items, sampling_params, seed, sink)

    def step(self) -> list[Event]:
        """Run one scheduler step; return the events without a sink. A request that makes
        the step fail ends alone, with finish_reason "error"; the only exception raised is
        EngineError, when no request can be blamed (the worker then gives up its jobs)."""
        self._advance()
        out, self.front.outbox = self.front.outbox, []
        return out

    def _advance(self) -> None:
        """One step whose sink-less events stay in the outbox for the next step() caller."""
        try:  # free until something raises
            self.front.collect(self.scheduler.step())
        except EngineError:
            raise
        except Exception as e:
            # Outside the parts that blame requests (the forward and sampler, each request's
            # fan-in): batch building or KV bookkeeping, whose state is now in doubt.
            raise EngineError(f"engine step failed: {type(e).__name__}: {e}") from e

    def abort(self, tag: Any) -> int:
        """Abort every request of tag; their KV is freed now. Returns how many."""
        return self.front.abort(tag)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.front.outbox)

    def has_room(self) -> bool:
        """Worth taking another job now: the waiting queue is short."""
        return len(self.scheduler.waiting) < max(8, self.scheduler.cfg.max_running // 4)

    def flush_cache(self) -> int:
        """Drop every unreferenced prefix from the radix cache. Returns pages freed."""
        return self.kv_manager.cache.evict(self.kv_manager.cache.evictable_pages)

    def check(self) -> None:
        """KV invariant (free + cached + in use == total)."""
        self.scheduler.check()

    # -- offline interface -------------------------------------------------------

    def prompt_logits(self, input_ids: list[list[int]]) -> list[tuple[int, torch.Tensor]]:
        """Teacher-forced logits of each prompt: (start, logits [len - start, vocab]) where
        the first `start` positions came from the prefix cache and were not recomputed."""
        reqs = [Req(rid=f"logits.{id(input_ids)}.{i}", input_ids=list(ids),
                    params=SamplingParams(max_new_tokens=0), seed=0, return_prompt_logits=True)
                for i, ids in enumerate(input_ids)]
        for r in reqs:
            self.scheduler.add(r)
        while not all(r.finished for r in reqs):
            self._advance()
        return [(r.cached_tokens, torch.cat(r.prompt_logits)) for r in reqs]

    def generate(self, prompts: list[str] | str | None = None,
                 input_ids: list[list[int]] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 seed: int | None = None, stream: bool = False):
        """Results in index order, or with stream=True an iterator of events in completion
        order. `sampling_params`: one object for all items (its seed is the job seed unless
        `seed` is given) or one per item (an item's own seed makes its samples independent
        of where it sits)."""
        if (prompts is None) == (input_ids is None):
            raise ValueError("give exactly one of prompts or input_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        src = prompts if prompts is not None else input_ids
        if not src:
            raise ValueError("prompts: the batch is empty")
        items = [(i, x, None) if prompts is not None else (i, None, x) for i, x in enumerate(src)]
        sp, seed = per_item(sampling_params, len(items), seed)
        events = self._run(items, sp, seed)
        return events if stream else self._gather(events, len(items))

    def _run(self, items, sp, seed) -> Iterator[Event]:
        tag = object()
        box: list[Event] = []
        self.add(tag, items, sp, seed, sink=box.append)
        want = sum(p.n for p in sp)
        done = 0
        try:
            while done < want:
                if not box:
                    self._advance()
                for ev in box:
                    done += ev.finished
                    yield ev
                box.clear()
        finally:
            if done < want:
                self.abort(tag)

    @staticmethod
    def _gather(events, n_items: int) -> list[ItemResult]:
        items = [ItemResult(i, []) for i in range(n_items)]
        for ev in sorted((e for e in events if e.finished), key=lambda e: (e.index, e.sample)):
            items[ev.index].samples.append(SampleResult(
                ev.text, ev.token_ids, ev.finish_reason, ev.usage, ev.error, ev.logprobs,
                ev.matched_stop))
        return items
