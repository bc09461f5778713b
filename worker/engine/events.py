"""What the engine hands back: streaming events and the per-item results built from them.

Logprobs (when a request asks, `logprobs=True`) are one record per generated token, the
same dict from the engine to the results store, the stream and the HTTP results:

    {"token_id": 42, "token": " the", "logprob": -0.31,
     "top_logprobs": [{"token_id": 42, "token": " the", "logprob": -0.31}, ...]}

`token` is `tokenizer.decode([token_id])`; `top_logprobs` holds the `top_logprobs` most
likely tokens, best first (empty when 0). Logprobs are the log_softmax of the model's raw
logits: before penalties, temperature and top-k / top-p / min-p, so a sampled token may be
outside its position's top tokens.

Prompt logprobs (`prompt_logprobs=k`) are the same records for the prompt's tokens, each
scored given the tokens before it (teacher forcing): one per prompt token, the first with
`logprob` and `top_logprobs` null (nothing comes before it), on the sample's final event
and result.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    completion_tokens: int


@dataclass(slots=True)
class Event:
    """One step's news for one (index, sample) of a caller's batch. Deltas concatenate to
    the final text; the final event (finished=True) carries the full result too. Logprobs
    are None unless the request asked."""
    tag: object  # the caller's opaque handle, as given to add
    index: int
    sample: int
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[dict] | None = None  # records of token_ids_delta
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    logprobs: list[dict] | None = None  # records of token_ids
    usage: Usage | None = None
    matched_stop: str | int | None = None  # the stop string or token id that ended it
    prompt_logprobs: list[dict] | None = None  # final event, when asked: one per prompt token
    # Final event of a chat item with tools (tools.py): the calls parsed out of the text
    # ({"name", "arguments" JSON text}; [] for none) and the text that is not a call.
    tool_calls: list[dict] | None = None
    content: str | None = None
    embedding: str | None = None  # an embedder's final event: base64 of the float32 vector


@dataclass(slots=True)
class SampleResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    error: str | None = None
    logprobs: list[dict] | None = None  # one record per token of token_ids, when asked
    matched_stop: str | int | None = None
    prompt_logprobs: list[dict] | None = None  # one per prompt token (the first's logprob null), when asked
    tool_calls: list[dict] | None = None  # with tools: the calls (see Event)
    content: str | None = None  # with tools: the text that is not a call


@dataclass(slots=True)
class ItemResult:
    index: int
    samples: list[SampleResult]

    @property
    def text(self) -> str:
        return self.samples[0].text
