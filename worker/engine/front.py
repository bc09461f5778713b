"""Fan-out / fan-in: a caller's batch becomes rid-tagged requests; their tokens come back
as (index, sample)-tagged events.

Fan-out tokenizes the batch (in one call when every item is text; a chat through its
template: chat.py; a chat with images once the intake has loaded them: intake.py), gives
each (item, sample) a rid, a seed derived from (job seed, item, sample) and, when its output
has a grammar, a matcher of that grammar (compiled once: grammar.py), and for n > 1 first
runs one max_new_tokens=0 warm-up per distinct prompt - all warm-ups in the same step - so
the n samples find the prompt in the radix cache. Fan-in detokenizes incrementally, applies
stop strings, and turns scheduler output into events in completion order.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import secrets
from dataclasses import dataclass
from typing import Callable

from . import tools
from .chat import ChatEncoder
from .detokenizer import Detokenizer
from .events import Event, Usage
from .images import ImageSpan
from .grammar import GrammarError, Grammars
from .encoder import Encoder
from .intake import Call, ImageIntake, Pending, TextIntake
from .req import Req
from .sampler import TokenLogprob
from .sampling_params import SamplingParams, per_item
from .scheduler import Scheduler, StepResult, step_error

Sink = Callable[[Event], None]

log = logging.getLogger("fanout.engine")


def derive_seed(job_seed: int, index: int, sample: int) -> int:
    """Seed of sample `sample` of item `index`: the same on any machine, in any batch."""
    h = hashlib.blake2b(f"{job_seed}:{index}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def item_seed(seed: int, sample: int) -> int:
    """Seed of sample `sample` of an item with its own seed: the same wherever the item sits
    (its index and job do not enter)."""
    h = hashlib.blake2b(f"item:{seed}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


@dataclass(slots=True)
class _Stream:
    """Fan-in state of one rid."""
    req: Req
    detok: Detokenizer
    sink: Sink | None
    logprobs: list[dict] | None = None  # records of the tokens so far, when asked


@dataclass(slots=True)
class _Warmup:
    req: Req
    samples: list[Req]  # to add once the warm-up has prefilled the shared prompt
    sink: Sink | None


class Front:
    def __init__(self, scheduler: Scheduler, tokenizer, max_context: int, kv_tokens: int,
                 eos_ids: set[int], vocab_size: int, chats: ChatEncoder, image_memory: int):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.chats = chats
        self.encoder = Encoder(tokenizer, chats)  # on this thread: chats whose images were loaded
        self.intake = ImageIntake(chats, max_context, image_memory)  # chat items with images
        self.text = TextIntake(self.encoder.copy().encode)  # every other text or chat item
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.kv_tokens = kv_tokens
        self.eos_ids = frozenset(eos_ids)
        self.grammars = Grammars(tokenizer, vocab_size, self.eos_ids)
        self.tool_format = chats.tool_format  # (tools.format_of)
        self.streams: dict[str, _Stream] = {}
        self.warmups: dict[str, _Warmup] = {}
        self.outbox: list[Event] = []  # events without a sink, until take_events()
        self.pieces: dict[int, str] = {}  # token id -> its text alone, for logprobs records
        self._ids = itertools.count()
        self.warmup_count = 0

    # -- fan-out -----------------------------------------------------------------

    def add(self, tag: object, items: list[tuple], params, seed: int | None,
            sink: Sink | None, owner: object = None, lora: int = 0) -> int:
        """items: (index, prompt or None, input_ids or None), a prompt being a text or a chat
        (a list of messages); params: one SamplingParams for all or one per item (see
        sampling_params.per_item). Texts and chats are encoded on the text intake's thread, a
        chat with images once the image intake has loaded them; feed() fans them out.
        `owner` (default: the tag): whose fair share of the engine the requests use when
        several owners' requests compete (scheduler.py); `lora` the adapter slot they run under
        (lora.py; 0: the base model). Returns the job seed used."""
        params, seed = per_item(params, len(items), seed)
        if seed is None:
            seed = secrets.randbits(63)
        for index, prompt, ids in items:
            if (prompt is None) == (ids is None):
                raise ValueError(f"items[{index}]: give exactly one of prompt or input_ids")
        call = Call(tag, tag if owner is None else owner, next(self._ids), seed, sink, lora)
        urls = [self.chats.image_urls(prompt) for _, prompt, _ in items]
        self.intake.put([Pending(call, index, chat, p)
                         for (index, chat, _), p, u in zip(items, params, urls) if u])
        self.text.put([Pending(call, index, prompt, p)
                       for (index, prompt, _), p, u in zip(items, params, urls) if not u and prompt is not None])
        given = [(index, list(ids), [], None, p) for (index, prompt, ids), p in zip(items, params)
                 if prompt is None]
        if given:  # token ids need no encoding (they are checked when fanned out)
            self._fan_out(call, given)
        return seed

    def feed(self, block: bool) -> None:
        """Fan out the items the intakes have encoded: texts and chats (their thread), and
        chats whose images were loaded (encoded here). `block`: the engine has nothing else
        to do, so wait a little for them."""
        waiting_text = len(self.text) > 0  # wait on one intake, not spin between two
        # A job with nothing here yet (a small one beside a huge one) joins the next step
        # rather than after it: a step of the others can take 20x its own.
        newcomer = waiting_text and any(owner not in self.scheduler.owners for owner in self.text.owners())
        for items, encoded in self.text.ready(waiting_text and (block or newcomer)):
            if not items:  # aborted while it was encoded (a slice is one add() call's: all or none)
                continue
            if isinstance(encoded, Exception):  # the encoder itself failed: the slice's items fail
                encoded = [([], [], f"encoding failed: {type(encoded).__name__}: {encoded}")] * len(items)
            self._fan_out(items[0].call, [(it.index, *enc, it.params) for it, enc in zip(items, encoded)])
        for items, images in self.intake.ready(block and not waiting_text):
            for it in items:
                enc = self.encoder.encode_chat(it.index, it.chat, images, it.params)
                self.intake.hold(self._fan_out(it.call, [(it.index, *enc, it.params)]))

    def _fan_out(self, call: Call, entries: list[tuple]) -> list[Req]:
        """Requests for entries (index, ids, image spans, error, params), to the scheduler
        (n > 1: behind one warm-up per distinct prompt); returns them."""
        by_prompt: dict[tuple, _Warmup] = {}
        made = []
        sink, group = call.sink, call.group
        for index, ids, spans, error, p in entries:
            error = error or self._check(ids, p, spans)
            grammar, matchers = p.grammar_on(self.tool_format), [None] * p.n
            if error is None and grammar is not None:
                try:  # compiled once per distinct grammar; a matcher per sample
                    matchers = [self.grammars.matcher(grammar) for _ in range(p.n)]
                except GrammarError as e:
                    error = f"{grammar[0]}: {e}"
            reqs = [Req(rid=f"{group}.{index}.{j}", input_ids=ids, params=p,
                        seed=derive_seed(call.seed, index, j) if p.seed is None else item_seed(p.seed, j),
                        eos_ids=self.eos_ids, tag=call.tag, owner=call.owner, index=index, sample=j,
                        grammar=matchers[j], images=spans, lora=call.lora) for j in range(p.n)]
            made += reqs
            # Image positions have no text to give the first output tokens context.
            text_ids = [t for t in ids if t < self.vocab_size] if spans else ids
            for r in reqs:
                self.streams[r.rid] = _Stream(r, Detokenizer(self.tokenizer, p.stop,
                                                              p.skip_special_tokens, text_ids),
                                              sink, [] if p.logprobs else None)
            if error:
                for r in reqs:
                    self.scheduler.finish(r, "error", error)
                    self._emit(self._final(self.streams.pop(r.rid), ""), sink)
            elif p.n > 1:
                key = tuple(ids)
                if key not in by_prompt:
                    warm = Req(rid=f"{group}.{index}.w", input_ids=ids,
                               params=SamplingParams(max_new_tokens=0, prompt_logprobs=p.prompt_logprobs),
                               seed=0, tag=call.tag,
                               owner=call.owner, images=spans, lora=call.lora)
                    by_prompt[key] = _Warmup(warm, [], sink)
                by_prompt[key].samples.extend(reqs)
            else:
                self.scheduler.add(reqs[0])
        for w in by_prompt.values():  # all warm-ups join the same step
            self.warmups[w.req.rid] = w
            self.warmup_count += 1
            self.scheduler.add(w.req)
            made.append(w.req)
        return made

    def _check(self, ids: list[int], p: SamplingParams, images: list[ImageSpan]) -> str | None:
        if not ids:
            return "prompt is empty"
        pads = {s.image.pad for s in images}  # image positions: past the vocabulary by design
        bad = next((t for t in ids if not 0 <= t < self.vocab_size and t not in pads), None)
        if bad is not None:
            return f"token id {bad} is outside the vocabulary (size {self.vocab_size})"
        if p.tools and p.effective_tool_choice == "auto" and self.tool_format is None:
            return "tool_choice: auto needs a chat template (this model has none)"
        if p.tools and p.effective_tool_choice == "auto" and self.tool_format == "generic" and p.grammar:
            return (f"{p.grammar[0]}: cannot be combined with tools under tool_choice auto on this model (its "
                    "template has no tool format: the answer is decoded under the generic format's schema)")
        if images and p.prompt_logprobs is not None:
            return "prompt_logprobs: not for a prompt with images (its image positions are not tokens)"
        if len(ids) >= self.max_context:
            expanded = f" ({len(images)} images expanded)" if images else ""
            return (f"prompt has {len(ids)} tokens{expanded}; the model's context is "
                    f"{self.max_context} (room for at least one new token is needed)")
        if min(len(ids) + p.max_new_tokens, self.max_context) > self.kv_tokens:
            return (f"prompt ({len(ids)} tokens) + max_new_tokens ({p.max_new_tokens}) exceeds "
                    f"the KV pool ({self.kv_tokens} tokens)")
        return None

    def take_events(self) -> list[Event]:
        """The events without a sink made since the last call."""
        out, self.outbox = self.outbox, []
        return out

    def has_events(self) -> bool:
        return bool(self.outbox)

    def abort(self, tag: object) -> int:
        # Items still in an intake have no requests yet: nothing to end.
        n = sum(p.params.n for p in self.intake.drop(tag) + self.text.drop(tag))
        for rid, w in list(self.warmups.items()):
            if w.req.tag == tag:
                del self.warmups[rid]
                self.scheduler.abort(rid)
                for r in w.samples:
                    self.scheduler.finish(r, "abort")
                    self._emit(self._final(self.streams.pop(r.rid), ""), w.sink)
                    n += 1
        for rid, s in list(self.streams.items()):
            if s.req.tag == tag and self.scheduler.abort(rid) is not None:
                self._emit(self._final(self.streams.pop(rid), s.detok.flush()), s.sink)
                n += 1
        return n

    # -- fan-in ------------------------------------------------------------------

    def collect(self, result: StepResult) -> None:
        """Turn one scheduler step into events (sent to sinks or the outbox). A fault in one
        request's part (detokenizing, stop strings, logprobs records) ends that request alone."""
        finished = {id(r) for r in result.finished}
        for req, tok in result.tokens:
            s = self.streams.get(req.rid)
            if s is None:
                continue
            try:  # free until something raises
                self._push(s, [tok], id(req) in finished)
            except Exception as e:
                self._fail(s, e, [tok])
        for req in result.finished:
            w = self.warmups.pop(req.rid, None)
            if w is not None:  # fan out the n samples on top of the warmed prefix
                for r in w.samples:
                    if req.finish_reason == "error":  # the samples' prefill would fail too
                        self.scheduler.finish(r, "error", req.error)
                        self._emit(self._final(self.streams.pop(r.rid), ""), w.sink)
                    else:
                        r.prompt_logprobs = req.prompt_logprobs  # scored once, for all n
                        self.scheduler.add(r)
            elif req.rid in self.streams:  # finished without a token this step
                s = self.streams.pop(req.rid)
                try:
                    self._emit(self._final(s, s.detok.flush()), s.sink)
                except Exception as e:
                    self._fail(s, e)

    def _push(self, s: _Stream, toks: list[int], finished: bool) -> None:
        req = s.req
        delta, stop = s.detok.push(toks)
        if stop is not None and not req.finished:  # decided here, applied in the one place
            self.scheduler.finish(req, "stop", matched_stop=stop)
            finished = True
        if finished:
            self._emit(self._final(s, delta + s.detok.flush(), toks), s.sink)
            del self.streams[req.rid]
        else:
            self._emit(Event(req.tag, req.index, req.sample, delta, list(toks),
                             self._logprobs(s)), s.sink)

    def _fail(self, s: _Stream, exc: Exception, toks: list[int] | tuple = ()) -> None:
        """End s's request with an error, its KV released. Its final event is built from
        what is already known, since making more failed: the text made so far (its delta the
        part not sent yet) and the step's tokens toks; logprobs records only of earlier ones."""
        r = s.req
        log.error("request %s failed in fan-in; it ends with an error", r.rid, exc_info=exc)
        error = step_error(exc)
        self.scheduler.finish(r, "error", error)
        self.streams.pop(r.rid, None)
        self._emit(Event(r.tag, r.index, r.sample, s.detok.unsent, list(toks), finished=True,
                         finish_reason="error", error=error, text=s.detok.text,
                         token_ids=list(r.output_ids), logprobs=s.logprobs,
                         usage=Usage(len(r.input_ids), r.cached_tokens, len(r.output_ids))), s.sink)

    def _logprobs(self, s: _Stream) -> list[dict] | None:
        """Records (see events.py) of the tokens sampled since the last call."""
        if s.logprobs is None:
            return None
        r, start = s.req, len(s.logprobs)
        new = [self._record(t, lp) for t, lp in zip(r.output_ids[start:], r.output_logprobs[start:])]
        s.logprobs += new
        return new

    def _prompt_logprobs(self, r: Req) -> list[dict] | None:
        """Records of the prompt's tokens, the first with logprob and top_logprobs null
        (nothing comes before it); None when not asked or not all computed (a request that
        ended before its prefill did)."""
        if r.params.prompt_logprobs is None or r.prompt_logprobs_todo:
            return None
        first = {"token_id": r.input_ids[0], "token": self._piece(r.input_ids[0]), "logprob": None,
                 "top_logprobs": None}
        return [first] + [self._record(t, lp) for t, lp in zip(r.input_ids[1:], r.prompt_logprobs)]

    def _record(self, token_id: int, lp: TokenLogprob) -> dict:
        return {"token_id": token_id, "token": self._piece(token_id), "logprob": lp.logprob,
                "top_logprobs": [{"token_id": i, "token": self._piece(i), "logprob": v} for i, v in lp.top]}

    def _piece(self, token_id: int) -> str:
        """The token's text decoded alone (as OpenAI shows it), once per id."""
        piece = self.pieces.get(token_id)
        if piece is None:
            piece = self.pieces[token_id] = self.tokenizer.decode([token_id])
        return piece

    def _final(self, s: _Stream, delta: str, toks: list[int] | tuple = ()) -> Event:
        r = s.req
        usage = Usage(len(r.input_ids), r.cached_tokens, len(r.output_ids))
        ev = Event(r.tag, r.index, r.sample, delta, list(toks), self._logprobs(s), True,
                   r.finish_reason, r.error, s.detok.text, list(r.output_ids), s.logprobs, usage,
                   r.matched_stop, self._prompt_logprobs(r))
        p = r.params
        if p.tools and r.finish_reason != "error":
            ev.content, ev.tool_calls = tools.parse(s.detok.text, self.tool_format, p.tools, p.effective_tool_choice)
        return ev

    def _emit(self, ev: Event, sink: Sink | None) -> None:
        (sink or self.outbox.append)(ev)
