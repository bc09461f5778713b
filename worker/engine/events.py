"""What the engine hands back: streaming events and the per-item results built from them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    completion_tokens: int


@dataclass(slots=True)
class Event:
    """One step's news for one (index, sample) of a caller's batch. Deltas concatenate to
    the final text; the final event (finished=True) carries the full result too."""
    tag: Any
    index: int
    sample: int
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[float] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    usage: Usage | None = None
    matched_stop: Any = None  # the stop string or token id that ended it


@dataclass(slots=True)
class SampleResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    error: str | None = None
    logprobs: list[float] | None = None
    matched_stop: Any = None


@dataclass(slots=True)
class ItemResult:
    index: int
    samples: list[SampleResult]

    @property
    def text(self) -> str:
        return self.samples[0].text
