"""The job contract between the API and the worker, defined once and imported by both.

A job travels as an rq job (JSON serializer, no pickles) that names `JOB_FUNC` with one
keyword argument, `spec`: a `JobSpec` dumped to JSON. The API validates the request, turns
it into a `JobSpec` (sampling parameters normalized to one per item, the job seed fixed)
and enqueues it on the queue of its priority; the worker parses it back with
`JobSpec.model_validate` and fails a payload that does not parse at once, without retry.

This module lives in worker/ (the worker runs what it describes) and imports neither the
web app nor torch.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .engine.sampling_params import SamplingParams, TokenId

QUEUES = {"high": "fanout-high", "normal": "fanout", "low": "fanout-low"}
QUEUE_ORDER = [QUEUES["high"], QUEUES["normal"], QUEUES["low"]]  # a worker takes from the first non-empty
JOB_FUNC = "worker.consumer.fanout_job"

Kind = Literal["prompts", "input_ids", "messages"]
KINDS: tuple[str, ...] = ("prompts", "input_ids", "messages")
NonEmptyStr = Annotated[str, Field(min_length=1)]
CustomId = Annotated[str, Field(min_length=1, max_length=512)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Message(Strict):
    role: Annotated[str, Field(min_length=1, max_length=64)]
    content: str


class JobInput(Strict):
    """The items of a job: exactly one of `prompts`, `input_ids`, `messages` (one chat per
    item, templated by the worker's tokenizer with the generation prompt)."""
    prompts: list[NonEmptyStr] | None = Field(None, min_length=1)
    input_ids: list[Annotated[list[TokenId], Field(min_length=1)]] | None = Field(None, min_length=1)
    messages: list[Annotated[list[Message], Field(min_length=1)]] | None = Field(None, min_length=1)
    custom_ids: list[CustomId | None] | None = Field(None, description=(
        "one per item (null for an item without one), unique within the job: returned with "
        "the item's results and on every stream entry of the item"))

    @model_validator(mode="after")
    def _one_input(self):
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("prompts / input_ids / messages: give exactly one of them"
                             + (f" (got {', '.join(given)})" if given else ""))
        if self.custom_ids is not None:
            if len(self.custom_ids) != self.size:
                raise ValueError(f"custom_ids: {len(self.custom_ids)} for {self.size} items")
            named = [c for c in self.custom_ids if c is not None]
            if len(set(named)) != len(named):
                raise ValueError("custom_ids: must be unique within the job")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def items(self) -> list:
        return getattr(self, self.kind)

    @property
    def size(self) -> int:
        return len(self.items)

    def custom_id(self, index: int) -> str | None:
        return self.custom_ids[index] if self.custom_ids else None


class JobSpec(JobInput):
    """What a worker runs: the items, one SamplingParams per item, the job seed."""
    sampling_params: list[SamplingParams]
    seed: int = Field(ge=0, lt=1 << 63)

    @model_validator(mode="after")
    def _one_per_item(self):
        if len(self.sampling_params) != self.size:
            raise ValueError(f"sampling_params: {len(self.sampling_params)} for {self.size} items")
        return self

    def payload(self) -> dict[str, Any]:
        """The rq job's JSON argument (defaults left out: a 10,000-item job stays small)."""
        return self.model_dump(mode="json", exclude_defaults=True)
