"""The engine: model runner, KV manager, scheduler, executor and the fan-out/fan-in front,
driven step by step.

The worker drives it with add / step / abort; `generate` is the offline call built on
the same steps. One step: Front.feed (chat items whose images are loaded) ->
Scheduler.schedule -> Executor.run (forward + sample) -> Scheduler.process (apply, finish)
-> Front.collect (events).

Overlap (EngineConfig.overlap_schedule): the forward and sampling of step N run on a thread
while this thread collects step N-1 (detokenizing, stop strings, events), so that work hides
behind the forward. A step's events therefore come out with the next step; a request that
N-1's stop strings end still runs in N, and N's token for it is dropped (Scheduler.process);
the samples of an n > 1 prompt join a step later. Tokens are the same either way: draws
depend on (seed, position) only.
"""
from __future__ import annotations

import gc
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .bound import TextBound
from .chat import ChatEncoder, VisionInput
from .config import EngineConfig
from .events import Event, ItemResult, SampleResult
from .executor import EngineError, Executor, RunOutput
from .front import Front
from .images import DecodeBudget, ImageSpan, image_processor
from .kv_manager import KVManager
from .model_runner import ModelRunner
from .models.loader import load_tokenizer, resolve_model_path
from .req import Req
from .sampler import Sampler
from .sampling_params import SamplingParams, per_item
from .scheduler import Scheduler, StepResult

log = logging.getLogger("fanout.engine")


def freeze_gc() -> int:
    """For a process that keeps one engine for its life (`fanout worker`, `fanout generate`):
    move every object alive now out of the cyclic GC's full collections. Each of those
    otherwise walks the model's, tokenizer's and libraries' objects, ~390,000 with SmolLM2
    loaded, 360 ms on a 2-core x86: a stall of the loop, several times in a big job. After
    it, a full collection walks only what came later. Frozen objects are never collected
    by the GC, so this is not for a process that makes and drops engines. Returns how
    many objects it froze."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@dataclass(slots=True)
class EngineStats:
    """Counters and gauges for metrics."""
    prefill_tokens: int  # run through prefill (prompts not served by the cache, recomputation)
    decode_tokens: int
    retractions: int
    failed_steps: int  # steps whose forward raised
    running: int  # requests holding KV
    waiting: int
    kv_pages_total: int
    kv_pages_free: int
    kv_pages_cached: int  # in the radix cache (some shared by running requests)


class Engine:
    task = "generate"  # the kind of jobs it runs (jobs/spec.py TASKS); worker.embedder's is "embed"

    def __init__(self, model: str, config: EngineConfig | None = None, **options):
        """`config`, or its fields as keywords (`Engine(path, device="cuda", kv_tokens=...)`)."""
        if config is not None and options:
            raise TypeError("give config or its fields as keywords, not both")
        self.config = cfg = config or EngineConfig(**options)
        self.tokenizer = load_tokenizer(model)
        self.runner = ModelRunner(model, cfg)
        mc = self.runner.config
        self.max_context = mc.max_context
        try:  # (under tensor parallel, the other ranks size and bind their pools with this one)
            self.kv_manager = KVManager.create(mc, self.runner.kv_tokens_to_allocate(), cfg.page_size,
                                               cfg.max_running, cfg.enable_prefix_cache,
                                               self.runner.dtype, self.runner.device)
            self.runner.attach_kv(self.kv_manager.kv, self.kv_manager.rtt)
        except BaseException as e:
            raise self.runner.abort(e)
        self.scheduler = Scheduler(cfg, self.kv_manager, self.max_context, self.runner.device.type)
        self.executor = Executor(self.runner, Sampler(mc.vocab_size, self.runner.device),
                                 self.kv_manager)
        eos = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        vision = None
        if mc.vision is not None:
            vision = VisionInput(image_processor(resolve_model_path(model), mc.vision),
                                 mc.vision.image_token_id, mc.vocab_size)
        self.front = Front(self.scheduler, self.tokenizer, self.max_context,
                           self.kv_manager.num_tokens, eos, mc.vocab_size,
                           ChatEncoder(self.tokenizer, vision, cfg.image_sources,
                                       TextBound(self.tokenizer, self.max_context),
                                       DecodeBudget(cfg.image_memory)), cfg.image_memory)
        self._forwards: ThreadPoolExecutor | None = None  # overlap's thread, made when first used
        self._uncollected: StepResult | None = None  # overlap: the step whose events are due

    # -- step-level interface (the worker drives these) --------------------------

    def add(self, tag: object, items: list[tuple], sampling_params, seed: int | None = None,
            sink: Callable[[Event], None] | None = None, owner: object = None, lora: str | None = None) -> int:
        """Queue items (index, prompt or None, input_ids or None) under tag. Their events go
        to sink, or are returned by step() when no sink is given. `owner` (default: tag):
        requests of several owners share the slots fairly (a worker's owner is the job, whose
        shards are tags). `lora`: the LoRA adapter they run under (its name; None: the base
        model; ValueError for one not loaded). Returns the job seed."""
        return self.front.add(tag, items, sampling_params, seed, sink, owner, self.lora_slot(lora))

    def adapters(self) -> list[str]:
        """The LoRA adapters it serves, by name."""
        return sorted(self.runner.loras.adapters) if self.runner.loras is not None else []

    def lora_slot(self, name: str | None) -> int:
        if name is None:
            return 0
        if self.runner.loras is None:
            raise ValueError(f"no LoRA adapter {name!r}: this engine serves none (lora, max_loras)")
        try:
            return self.runner.loras.slot(name)
        except KeyError as e:
            raise ValueError(e.args[0]) from None

    def load_lora(self, name: str, path: str):
        """Load one more LoRA adapter (PEFT's format) into a free slot; lora.LoraError if it
        cannot be served. Its requests may come at once."""
        if self.runner.loras is None:
            raise ValueError("this engine holds no LoRA slots: start it with max_loras")
        return self.runner.loras.load(name, path)

    def served(self) -> dict:
        """The model's entry among the served models (keys.models), beside created/expires:
        what the API checks a request against."""
        return {"task": self.task, "images": self.image_schemes(), "max_model_len": self.max_context,
                "tools": self.front.tool_format}

    def image_schemes(self) -> list[str]:
        """The image URL schemes chats may use ([] for a text model)."""
        return self.front.chats.schemes

    def step(self) -> list[Event]:
        """Run one scheduler step; return the events without a sink. A request that makes
        the step fail ends alone, with finish_reason "error"; the only exception raised is
        EngineError, when no request can be blamed (the worker then gives up its jobs)."""
        self._advance()
        return self.front.take_events()

    def _advance(self) -> None:
        """One step whose sink-less events stay with the front for the next step() caller."""
        try:  # free until something raises
            # Chat items whose images are loaded join (a step with nothing else to run
            # waits a little for them).
            self.front.feed(block=not self.scheduler.has_work() and self._uncollected is None)
            batch = self.scheduler.schedule()
            if not self.config.overlap_schedule:  # (may be switched between steps)
                self._collect_due()
                run = self.executor.run(batch) if batch is not None else RunOutput()
                self.front.collect(self.scheduler.process(run))
            else:
                self._overlapped(batch)
        except EngineError:
            raise
        except Exception as e:
            # Outside the parts that blame requests (the forward and sampler, each request's
            # fan-in): batch building or KV bookkeeping, whose state is now in doubt.
            raise EngineError(f"engine step failed: {type(e).__name__}: {e}") from e

    def _overlapped(self, batch) -> None:
        """Step N's forward on the thread, step N-1's fan-in here meanwhile (module doc). A
        fault in preparing or running the batch is isolated as in a serial step."""
        job, exc = None, None
        if self._forwards is None:
            self._forwards = ThreadPoolExecutor(1, thread_name_prefix="fanout-forward")
        if batch is not None:
            try:  # free until something raises
                job = self._forwards.submit(self.executor.forward, self.executor.prepare(batch))
            except Exception as e:
                exc = e
        try:
            self._collect_due()
        finally:  # the forward never outlives the step, whatever happened here
            if job is not None:
                try:
                    run = RunOutput([job.result()])
                except Exception as e:
                    exc = e
        if exc is not None:
            run = self.executor.recover(batch, exc)
        elif job is None:
            run = RunOutput()
        result = self.scheduler.process(run)
        self._uncollected = result if result.tokens or result.finished else None

    def _collect_due(self) -> None:
        """Fan in the step an overlapped step left for the next one, if any."""
        if self._uncollected is not None:
            due, self._uncollected = self._uncollected, None
            self.front.collect(due)

    def abort(self, tag: object) -> int:
        """Abort every request of tag; their KV is freed now. Returns how many."""
        return self.front.abort(tag)

    def has_work(self) -> bool:
        return (self.scheduler.has_work() or self.front.has_events() or len(self.front.intake) > 0
                or len(self.front.text) > 0 or self._uncollected is not None)

    def has_room(self) -> bool:
        """Worth taking another shard now: the scheduler has room (samples waiting for their
        prompt's warm-up count as waiting) and few chat items wait for their images (a slow
        download must not hold up other jobs' shards)."""
        return (self.scheduler.has_room(self._pending())
                and len(self.front.intake) < max(8, self.config.max_running // 4))

    def has_room_for_owner(self) -> bool:
        """Worth taking a shard of an owner (a job) with nothing here although has_room() is
        false: its requests would get a fair share of the slots (scheduler.py)."""
        return self.scheduler.has_room_for_owner(self._pending())

    def _pending(self) -> int:
        """Samples on their way to the scheduler: being tokenized, or behind their prompt's
        warm-up."""
        return len(self.front.text) + sum(len(w.samples) for w in self.front.warmups.values())

    def close(self) -> None:
        """Stop the tensor-parallel ranks this engine started, if any (a process that exits
        stops them anyway)."""
        self.runner.close()

    def flush_cache(self) -> int:
        """Drop every unreferenced prefix from the radix cache. Returns pages freed."""
        return self.kv_manager.flush_cache()

    def check(self) -> None:
        """KV invariant (free + cached + in use == total)."""
        self.scheduler.check()

    def stats(self) -> EngineStats:
        s, kvm = self.scheduler, self.kv_manager
        return EngineStats(s.prefill_tokens_total, s.decode_tokens_total, s.num_retractions,
                           self.executor.failed_steps, len(s.running), len(s.waiting),
                           kvm.alloc.total, kvm.alloc.num_free, kvm.cache.cached_pages)

    # -- offline interface -------------------------------------------------------

    def prompt_logits(self, input_ids: list[list[int]],
                      images: list[list[ImageSpan]] | None = None) -> list[tuple[int, torch.Tensor]]:
        """Teacher-forced logits of each prompt: (start, logits [len - start, vocab]) where
        the first `start` positions came from the prefix cache and were not recomputed.
        `images`: each prompt's image spans (from `front.chats.encode`), if it has any."""
        images = images or [[] for _ in input_ids]
        reqs = [Req(rid=f"logits.{id(input_ids)}.{i}", input_ids=list(ids),
                    params=SamplingParams(max_new_tokens=0), seed=0, return_prompt_logits=True,
                    images=list(spans))
                for i, (ids, spans) in enumerate(zip(input_ids, images))]
        for r in reqs:
            self.scheduler.add(r)
        while not all(r.finished for r in reqs):
            self._advance()
        return [(r.cached_tokens, torch.cat(r.prompt_logits)) for r in reqs]

    def generate(self, prompts: list[str] | str | None = None,
                 input_ids: list[list[int]] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 seed: int | None = None, stream: bool = False,
                 messages: list[list[dict]] | None = None, lora: str | None = None):
        """Results in index order, or with stream=True an iterator of events in completion
        order. Items: exactly one of `prompts`, `input_ids` or `messages` (chats of
        OpenAI-style messages, rendered by the model's chat template; a content may be a
        list of text and image_url parts, see chat.py). `sampling_params`: one object for all
        items (its seed is the job seed unless `seed` is given) or one per item (an item's
        own seed makes its samples independent of where it sits). `lora`: a loaded LoRA
        adapter's name to run them under (None: the base model)."""
        if sum(x is not None for x in (prompts, input_ids, messages)) != 1:
            raise ValueError("give exactly one of prompts, input_ids or messages")
        if isinstance(prompts, str):
            prompts = [prompts]
        src = next(x for x in (prompts, messages, input_ids) if x is not None)
        if not src:
            raise ValueError("prompts: the batch is empty")
        items = [(i, x, None) if input_ids is None else (i, None, x) for i, x in enumerate(src)]
        sp, seed = per_item(sampling_params, len(items), seed)
        slot = self.lora_slot(lora)  # an unknown adapter refused before anything is queued
        events = self._run(items, sp, seed, lora if slot else None)
        return events if stream else self._gather(events, len(items))

    def _run(self, items, sp, seed, lora: str | None = None) -> Iterator[Event]:
        tag = object()
        box: list[Event] = []
        self.add(tag, items, sp, seed, sink=box.append, lora=lora)
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
                ev.matched_stop, ev.prompt_logprobs, ev.tool_calls, ev.content))
        return items
