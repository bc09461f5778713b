"""Request and response bodies of the job API (pydantic). Unknown fields are rejected."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AwareDatetime, BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo,
                      field_validator, model_validator)

Priority = Literal["high", "normal", "low"]
Status = Literal["queued", "scheduled", "running", "succeeded", "failed", "canceled"]
NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SamplingParamsIn(Strict):
    """Names and meanings follow SGLang."""
    max_new_tokens: int = Field(128, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 or 0 disables; else >= 1")
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    stop: list[NonEmptyStr] | NonEmptyStr = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=0, lt=2**63)
    logprobs: bool = False
    skip_special_tokens: bool = True

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError("must be -1 (off), 0 (off) or >= 1")
        return v

    @model_validator(mode="after")
    def _min_le_max(self):
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError("min_new_tokens: must be <= max_new_tokens")
        return self


class Message(Strict):
    role: NonEmptyStr
    content: str


# One object for every item, or a list with one per item. The tags are dropped from error
# locations (api.app) so an error reads body.sampling_params.top_p or body.sampling_params.2.n.
SamplingParamsField = Annotated[
    Annotated[SamplingParamsIn, Tag("one")] | Annotated[list[SamplingParamsIn], Tag("per_item")],
    Discriminator(lambda v: "per_item" if isinstance(v, list) else "one"),
]
UNION_TAGS = frozenset({"one", "per_item"})


class JobRequest(Strict):
    """Exactly one of `prompts`, `input_ids`, `messages` (chat, templated by the worker's
    tokenizer); `sampling_params` is one object for all items or a list, one per item."""
    prompts: list[NonEmptyStr] | None = Field(None, min_length=1)
    input_ids: list[Annotated[list[TokenId], Field(min_length=1)]] | None = Field(None, min_length=1)
    messages: list[Annotated[list[Message], Field(min_length=1)]] | None = Field(None, min_length=1)
    sampling_params: SamplingParamsField = Field(default_factory=SamplingParamsIn)
    seed: int | None = Field(None, ge=0, lt=2**63, description=(
        "job seed: sample j of item i draws from (seed, i, j); defaults to sampling_params.seed, "
        "else a random seed returned in the response"))
    priority: Priority = "normal"
    metadata: dict[str, Any] = Field(default_factory=dict, description="stored and returned as is")
    run_at: Annotated[AwareDatetime, Field(strict=False)] | None = Field(
        None, description="start no earlier than this (ISO 8601 with a zone)")

    @field_validator("sampling_params")
    @classmethod
    def _one_per_item(cls, v, info: ValidationInfo):
        items = next((info.data[k] for k in ("prompts", "input_ids", "messages") if info.data.get(k)), None)
        if isinstance(v, list) and items is not None and len(v) != len(items):
            raise ValueError(f"list has {len(v)} entries for {len(items)} items")
        return v

    @model_validator(mode="after")
    def _one_input(self):
        given = [k for k in ("prompts", "input_ids", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("prompts / input_ids / messages: give exactly one of them"
                             + (f" (got {', '.join(given)})" if given else ""))
        return self

    @property
    def kind(self) -> str:
        return next(k for k in ("prompts", "input_ids", "messages") if getattr(self, k) is not None)

    @property
    def items(self) -> list:
        return getattr(self, self.kind)

    @property
    def size(self) -> int:
        return len(self.items)

    def params_list(self) -> list[SamplingParamsIn]:
        sp = self.sampling_params
        return sp if isinstance(sp, list) else [sp] * self.size


class JobCreated(BaseModel):
    id: str
    status: Status
    stream: str = Field(description="Redis stream key of the job's events (XREAD it, or use /events)")
    seed: int
    items: int


class Progress(BaseModel):
    total: int = Field(description="items in the job")
    done: int = Field(description="items whose every sample finished (or failed)")
    failed: int = Field(description="items with a failed sample (e.g. prompt too long)")
    samples: int
    samples_done: int


class Usage(BaseModel):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class Batching(BaseModel):
    steps: int = Field(description="engine steps that advanced this job")
    max_batch_jobs: int = Field(description="most jobs seen together in one of those steps")


class JobInfo(BaseModel):
    id: str
    status: Status
    priority: Priority
    progress: Progress
    usage: Usage = Field(description="summed over samples")
    error: str | None
    seed: int
    attempt: int = Field(description="attempts started so far (retries after worker loss count)")
    metadata: dict[str, Any]
    stream: str
    run_at: str | None
    created_at: str | None
    started_at: str | None
    ended_at: str | None
    batching: Batching


class SampleOut(BaseModel):
    sample: int
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    error: str | None


class ItemOut(BaseModel):
    index: int
    samples: list[SampleOut] = Field(description="finished samples so far, by sample index")


class ResultsPage(BaseModel):
    id: str
    status: Status
    offset: int
    limit: int
    total: int
    next_offset: int | None
    items: list[ItemOut]


class Canceled(BaseModel):
    id: str
    status: Status


class ErrorOut(BaseModel):
    detail: str


class Health(BaseModel):
    status: Literal["ok"]
    redis: str
