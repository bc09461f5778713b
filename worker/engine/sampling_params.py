"""Sampling parameters; names follow SGLang."""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt + output tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, over output tokens
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def copy(self, **changes) -> "SamplingParams":
        return replace(self, **changes)

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        def bad(name, why):
            raise ValueError(f"sampling_params.{name}: {why}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            bad("max_new_tokens", "must be an integer >= 0")
        if not isinstance(self.min_new_tokens, int) or self.min_new_tokens < 0:
            bad("min_new_tokens", "must be an integer >= 0")
        if self.min_new_tokens > self.max_new_tokens:
            bad("min_new_tokens", "must be <= max_new_tokens")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (0, -1)):
            bad("top_k", "must be -1 (off) or an integer >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be integers >= 0")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", "must be an integer >= 0")
