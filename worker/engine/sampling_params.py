"""Sampling parameters: the one definition of each (name, type, default, bounds, doc).

The engine uses this model; the HTTP API uses it as its request schema and the CLI builds
its flags from its fields, so they cannot drift. Names follow SGLang. Constructing one
validates it: a bad value raises pydantic's ValidationError (a ValueError) naming the field.
This module imports no torch: the API imports it.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_TOKENS = 1 << 20  # bound of every token count; the service sets lower limits (FANOUT_MAX_*)
MAX_TOKEN_ID = (1 << 31) - 1
MAX_TOP_LOGPROBS = 20  # as OpenAI

StopString = Annotated[str, Field(min_length=1, max_length=1024)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    max_new_tokens: int = Field(128, ge=0, le=MAX_TOKENS, description="new tokens at most per sample")
    min_new_tokens: int = Field(0, ge=0, le=MAX_TOKENS,
                                description="EOS and stop_token_ids are masked until this many")
    n: int = Field(1, ge=1, le=4096, description="samples per item")
    temperature: float = Field(1.0, ge=0, le=100, description="0 means greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling; 1 disables")
    top_k: int = Field(-1, ge=-1, le=MAX_TOKEN_ID, description="-1 or 0 disables; 1 is greedy")
    min_p: float = Field(0.0, ge=0, le=1, description="drop tokens below min_p x the top probability")
    repetition_penalty: float = Field(1.0, gt=0, le=100,
                                      description="transformers semantics, over prompt and output; 1 disables")
    frequency_penalty: float = Field(0.0, ge=-2, le=2, description="OpenAI semantics, over the output")
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="OpenAI semantics, over the output")
    stop: list[StopString] = Field([], max_length=64,
                                   description="stop strings (one string or a list): cut from the text")
    stop_token_ids: list[TokenId] = Field([], max_length=1024,
                                          description="token ids that end a sample, besides EOS")
    ignore_eos: bool = Field(False, description="keep going after EOS (up to max_new_tokens)")
    seed: int | None = Field(None, ge=0, lt=1 << 63, description=(
        "in one object for all items: the job seed (sample j of item i draws from (seed, i, j)); "
        "in an item's own params: that item's seed (sample j draws from (seed, j), wherever "
        "the item sits)"))
    logprobs: bool = Field(False, description="return the log-probability of each sampled token")
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS,
                              description="also the k most likely tokens at each position (needs logprobs)")
    skip_special_tokens: bool = Field(True, description="leave special tokens out of the text")

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v):
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _consistent(self):
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError("min_new_tokens: must be <= max_new_tokens")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def copy(self, **changes) -> "SamplingParams":
        """A validated copy with some fields changed."""
        return SamplingParams.model_validate({**self.model_dump(), **changes})


def per_item(sampling_params: SamplingParams | list[SamplingParams] | None, count: int,
             seed: int | None) -> tuple[list[SamplingParams], int | None]:
    """Normalize "one object for every item, or one per item" -> (one per item, job seed).

    One object: its `seed` is the job seed (unless `seed` is given) and leaves the params,
    so every item draws from (job seed, index, sample). A list: each item keeps its own
    `seed`, if any. The job seed is None when none was given (the caller picks one)."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        if seed is None:
            seed = sampling_params.seed
        one = sampling_params.copy(seed=None) if sampling_params.seed is not None else sampling_params
        return [one] * count, seed
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"sampling_params: got {len(params)} for {count} items")
    return params, seed
