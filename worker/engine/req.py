"""Per-request state: one rid = one (item, sample) of a caller's batch."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from .grammar import Matcher
    from .images import ImageSpan
    from .radix_cache import TreeNode
    from .sampler import TokenLogprob


class ReqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int  # per-sample seed, derived from (job seed, item index, sample index)
    eos_ids: frozenset[int] = frozenset()
    tag: object = None  # where events go (the caller's opaque handle: a job, a generate call)
    owner: object = None  # whose fair share of the slots it uses (scheduler.py): a job
    index: int = 0  # item index in the caller's batch
    sample: int = 0  # sample index within the item
    return_prompt_logits: bool = False
    grammar: Matcher | None = None  # a constrained output's matcher: advanced with each token
    # Images in the prompt, in position order; their positions in input_ids hold the image's
    # pad id (the radix cache key), the model replaces them with the image's features.
    images: list[ImageSpan] = field(default_factory=list)
    # The LoRA adapter it runs under: its slot in the engine's adapters (lora.py), 0 for the
    # base model. Also its prefix cache namespace (radix_cache.py).
    lora: int = 0

    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, when asked
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    # Extra info on the finish: the matched stop string or stop token.
    matched_stop: str | int | None = None

    # KV state. The first alloc_len positions have slots in req_to_token; the first kv_len
    # of fill_ids (prompt + generated so far: the tokens whose KV it needs) have their KV in
    # the pool, the first prefix_len of those borrowed from the radix cache (locked at
    # last_node). Invariant: prefix_len <= kv_len <= alloc_len.
    req_pool_idx: int | None = None
    kv_len: int = 0
    prefix_len: int = 0
    alloc_len: int = 0  # positions with a slot allocated (>= kv_len during a step)
    last_node: TreeNode | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage)
    num_retractions: int = 0
    ran_at: int = 0  # the last step it ran in (step shares take turns by it: scheduler.py)
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # chunks of [n, vocab] when asked
    # With params.prompt_logprobs: of input_ids[1:], in order, as the prefill computes them.
    # Samples of one prompt share its warm-up's list.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    def tokens(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end], without building the whole list."""
        n = len(self.input_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        if end <= n:
            return self.input_ids[start:end]
        return self.input_ids[start:] + self.output_ids[:end - n]

    def positions(self, start: int, end: int) -> range | tuple[list[int], ...]:
        """Rotary positions of fill_ids[start:end]: one row (a range), or M-RoPE's three rows
        (t, h, w) when the run holds tokens of an M-RoPE image. A text token at index i sits
        at i + the shifts of the images before it (images.py); the k-th token of an image of
        token grid (t, h, w) starting at s, at s + those shifts + (k // (h*w), k // w % h,
        k % w) in the three rows."""
        shift, at, rows = 0, start, None  # at: the first index not placed yet
        for span in self.images:
            s, e = span.start, span.start + span.length
            if e <= start or span.image.grid is None:
                shift += span.shift
                continue
            if s >= end:
                break
            rows = rows or ([], [], [])
            for row in rows:  # the text before the image
                row.extend(range(at + shift, max(s, start) + shift))
            _, h, w = span.image.grid
            for k in range(max(s, start) - s, min(e, end) - s):
                rows[0].append(s + shift + k // (h * w))
                rows[1].append(s + shift + k // w % h)
                rows[2].append(s + shift + k % w)
            shift += span.shift
            at = min(e, end)
        if rows is None:
            return range(start + shift, end + shift)
        for row in rows:
            row.extend(range(at + shift, end + shift))
        return rows

    @property
    def prompt_logprobs_todo(self) -> bool:
        """Asked for prompt logprobs and some are not computed yet."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.input_ids) - 1)

    @property
    def all_logits(self) -> bool:
        """The forward keeps the logits of every position this request runs, not only the
        last: for its prompt logits or prompt logprobs."""
        return self.return_prompt_logits or self.prompt_logprobs_todo

    @property
    def max_prefix(self) -> int:
        """Tokens it may borrow from the prefix cache: not the positions whose logits it
        still needs (the logprob of prompt token i comes from position i - 1's logits)."""
        return len(self.prompt_logprobs) if self.prompt_logprobs_todo else self.seq_len - 1

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def extend_todo(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.seq_len - self.kv_len
