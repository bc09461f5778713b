"""The embedder: inputs -> tokens -> padded batches of similar lengths -> encoder (BERT's,
bert.py, or a decoder's, decoder.py) -> pooled, normalized vectors, one final Event per input. No KV cache, no sampling, no decode: one
forward per batch, and every input finishes in the step that runs it.

The worker drives it as it drives the generation engine (worker/attempts.py, publish.py):
add / step / abort / has_work / has_room / stats, `tokenizer` (shared for the API's
/tokenize) and `served()` (the model's entry among the served models).

Batching: the oldest waiting input anchors each batch (no input waits behind later ones for
long), and the waiting inputs nearest its length fill the batch up to `max_prefill_tokens`
padded tokens, so little of a batch is padding. The waiting line is kept short by
`has_room` (the worker takes a shard only when fewer than 16 batches' worth wait), which is
also what keeps jobs fair: a job's shard never waits behind more than that.

Invariant: an input is in `waiting` until the step that runs it, then its event is in
`done` until the caller takes it; abort removes both.
"""
from __future__ import annotations

import base64
import json
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.engine.config import EngineConfig
from worker.engine.engine import EngineStats
from worker.engine.events import Event, Usage
from worker.engine.model_runner import resolve_device, use_threads
from worker.engine.models.loader import resolve_dtype, resolve_model_path

from . import layout as layouts
from .bert import Bert
from .decoder import Decoder
from .params import EmbedParams, dimensions_error

log = logging.getLogger("fanout.embedder")


@dataclass(slots=True)
class Input:
    tag: object
    owner: object
    index: int
    ids: list[int]
    params: EmbedParams


class Embedder:
    task = "embed"

    def __init__(self, model: str, config: EngineConfig | None = None, **options):
        """`config` (EngineConfig: its device, dtype and max_prefill_tokens, the padded tokens
        of one batch), or those fields as keywords."""
        if config is not None and options:
            raise TypeError("give config or its fields as keywords, not both")
        cfg = config or EngineConfig(**options)
        if cfg.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size: an embedding model runs on one rank (1)")
        path = resolve_model_path(model)
        self.layout = layouts.read(path)
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            mc = json.load(f)
        use_threads(cfg.threads)
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype or ("bfloat16" if self.device.type == "cuda" else "float32"))
        # BERT's encoder, or a causal LM of the engine's registry (decoder.py)
        self.max_context = self.layout.max_tokens
        self.batch_tokens = max(cfg.max_prefill_tokens, self.max_context)
        self.encoder = Bert.load(path, mc, self.device, self.dtype, self.batch_tokens) \
            if mc.get("model_type") == "bert" else Decoder(path, mc, self.device, self.dtype, self.max_context)
        self.dim = mc["hidden_size"]
        self.vocab_size = mc["vocab_size"]
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(path)  # shared for /tokenize (member.py)
        # Its fast tokenizer, without the padding and truncation tokenizer.json may switch on.
        self._tok = self.tokenizer.backend_tokenizer.__class__.from_str(self.tokenizer.backend_tokenizer.to_str())
        self._tok.no_padding()
        self._tok.no_truncation()
        self._specials = self._tok.num_special_tokens_to_add(False)
        self.pad_id = mc.get("pad_token_id") or 0
        self.waiting: list[Input] = []
        self.done: list[Event] = []
        self.tokens_total = 0  # tokens run through the encoder (padding not counted)
        self.failed_steps = 0

    # -- the worker's interface (as worker.engine.Engine's) -------------------------

    def served(self) -> dict:
        """The model's entry among the served models (keys.models), beside created/expires."""
        return {"task": self.task, "images": [], "max_model_len": self.max_context, "tools": None,
                "dimensions": self.dim,
                "matryoshka": list(self.layout.matryoshka) if self.layout.matryoshka is not None else None}

    def image_schemes(self) -> list[str]:
        return []

    def adapters(self) -> list[str]:
        return []  # no LoRA adapters on embedding models

    def add(self, tag: object, items: list[tuple], params: EmbedParams, seed: int | None = None,
            sink=None, owner: object = None) -> int:
        """Queue items (index, text or None, input_ids or None) under tag; one EmbedParams for
        all. An input that cannot be embedded (too long without truncation, a token id outside
        the vocabulary, a chat) finishes at once with an error; the others are not affected.
        Raises ValueError for params this model cannot honor (the job's, not an item's)."""
        if sink is not None:
            raise ValueError("the embedder returns its events from step(); it takes no sink")
        self.check(params)
        owner = tag if owner is None else owner
        texts = [(k, p) for k, (_, p, ids) in enumerate(items) if ids is None and isinstance(p, str)]
        encoded = dict(zip((k for k, _ in texts), self._tok.encode_batch([p for _, p in texts],
                                                                          add_special_tokens=False)))
        limit = self._limit(params)
        for k, (index, prompt, ids) in enumerate(items):
            try:
                ids = self._ids(prompt, ids, encoded.get(k), limit, params)
            except ValueError as e:
                self.done.append(Event(tag, index, 0, finished=True, finish_reason="error", error=str(e),
                                       text="", token_ids=[], usage=Usage(0, 0, 0)))
                continue
            self.waiting.append(Input(tag, owner, index, ids, params))
        return 0

    def check(self, params: EmbedParams) -> None:
        if (why := dimensions_error(params.dimensions, self.dim, self.layout.matryoshka)) is not None:
            raise ValueError(f"dimensions: {why}")

    def _limit(self, params: EmbedParams) -> int:
        t = params.truncate_prompt_tokens
        return self.max_context if t is None or t == -1 else min(t, self.max_context)

    def _ids(self, prompt, ids, enc, limit: int, params: EmbedParams) -> list[int]:
        """An input's token ids: a text's with the special tokens, truncated when asked."""
        if ids is None:
            if not isinstance(prompt, str):
                raise ValueError("an embedding model takes texts or token ids, not chats")
            if len(enc.ids) + self._specials > limit:
                if params.truncate_prompt_tokens is None:
                    raise ValueError(f"{len(enc.ids) + self._specials} tokens, over the model's "
                                     f"{self.max_context} (truncate_prompt_tokens truncates)")
                enc.truncate(max(limit - self._specials, 0))
            ids = self._tok.post_process(enc).ids
        else:
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is outside the vocabulary (0 to {self.vocab_size - 1})")
            if len(ids) > limit:
                if params.truncate_prompt_tokens is None:
                    raise ValueError(f"{len(ids)} tokens, over the model's {self.max_context} "
                                     f"(truncate_prompt_tokens truncates)")
                ids = ids[:limit]
        if not ids:
            raise ValueError("no tokens to embed")
        return list(ids)

    def step(self) -> list[Event]:
        """Embed one batch; return every finished input's event since the last call."""
        if self.waiting:
            batch = self._take()
            try:
                self._run(batch)
            except Exception as e:  # noqa: BLE001 - the inputs at fault fail alone
                self.failed_steps += 1
                log.warning("a batch of %d inputs failed (%s: %s); running them one by one",
                            len(batch), type(e).__name__, e)
                for one in batch:
                    try:
                        self._run([one])
                    except Exception as e1:  # noqa: BLE001
                        self.done.append(Event(one.tag, one.index, 0, finished=True, finish_reason="error",
                                               error=f"embedding failed: {type(e1).__name__}: {e1}",
                                               text="", token_ids=[], usage=Usage(len(one.ids), 0, 0)))
        done, self.done = self.done, []
        return done

    def _take(self) -> list[Input]:
        """The oldest input and those nearest its length, up to batch_tokens padded tokens."""
        anchor = self.waiting[0]
        rest = sorted(range(1, len(self.waiting)), key=lambda i: abs(len(self.waiting[i].ids) - len(anchor.ids)))
        chosen, longest = [0], len(anchor.ids)
        for i in rest:
            n = max(longest, len(self.waiting[i].ids))
            if n * (len(chosen) + 1) > self.batch_tokens:
                break
            chosen.append(i)
            longest = n
        picked = set(chosen)
        batch = [self.waiting[i] for i in chosen]
        self.waiting = [x for i, x in enumerate(self.waiting) if i not in picked]
        return batch

    @torch.inference_mode()
    def _run(self, batch: list[Input]) -> None:
        lens = [len(x.ids) for x in batch]
        L = max(lens)
        ids = torch.full((len(batch), L), self.pad_id, dtype=torch.long)
        for r, x in enumerate(batch):
            ids[r, :len(x.ids)] = torch.tensor(x.ids)
        n = torch.tensor(lens)
        mask = torch.arange(L)[None, :] < n[:, None]
        ids, mask, n = ids.to(self.device), mask.to(self.device), n.to(self.device)
        hidden = self.encoder.forward(ids, None if min(lens) == L else mask).float()
        pooling = self.layout.pooling
        if pooling == "cls":
            v = hidden[:, 0]
        elif pooling == "last":
            v = hidden[torch.arange(len(batch), device=hidden.device), n - 1]
        else:
            v = (hidden * mask[..., None]).sum(1) / n[:, None]
        if self.layout.normalize:
            v = F.normalize(v, dim=-1)
        v = v.cpu()
        for r, x in enumerate(batch):
            vec = v[r]
            if x.params.dimensions is not None and x.params.dimensions < self.dim:
                vec = vec[:x.params.dimensions]
                if self.layout.normalize:
                    vec = F.normalize(vec, dim=-1)
            data = vec.numpy().astype("<f4").tobytes()
            self.done.append(Event(x.tag, x.index, 0, finished=True, finish_reason="stop", text="",
                                   token_ids=[], usage=Usage(len(x.ids), 0, 0),
                                   embedding=base64.b64encode(data).decode()))
        self.tokens_total += sum(lens)

    def abort(self, tag: object) -> int:
        before = len(self.waiting) + len(self.done)
        self.waiting = [x for x in self.waiting if x.tag != tag]
        self.done = [e for e in self.done if e.tag != tag]
        return before - len(self.waiting) - len(self.done)

    def has_work(self) -> bool:
        return bool(self.waiting or self.done)

    def has_room(self) -> bool:
        return sum(len(x.ids) for x in self.waiting) < 16 * self.batch_tokens

    def has_room_for_owner(self) -> bool:
        return False  # the waiting line is short (has_room): a job's shard soon gets its turn

    def stats(self) -> EngineStats:
        return EngineStats(self.tokens_total, 0, 0, self.failed_steps, 0, len(self.waiting), 0, 0, 0)

    # -- offline --------------------------------------------------------------------

    def embed(self, texts: list[str] | None = None, input_ids: list[list[int]] | None = None,
              params: EmbedParams | None = None) -> torch.Tensor:
        """Vectors [N, dim] of texts (or token ids), in order; ValueError naming the first
        input that cannot be embedded."""
        items = [(i, t, None) for i, t in enumerate(texts)] if texts is not None else \
            [(i, None, ids) for i, ids in enumerate(input_ids)]
        tag = object()
        self.add(tag, items, params or EmbedParams())
        out: dict[int, Event] = {}
        while len(out) < len(items):
            for e in self.step():
                if e.tag is tag:
                    out[e.index] = e
        errors = [e for e in out.values() if e.error]
        if errors:
            first = min(errors, key=lambda e: e.index)
            raise ValueError(f"input {first.index}: {first.error}")
        import numpy as np
        return torch.from_numpy(np.stack([np.frombuffer(base64.b64decode(out[i].embedding), "<f4")
                                          for i in range(len(items))]))
