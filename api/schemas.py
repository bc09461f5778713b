"""Request and response bodies of the job API (pydantic). Unknown fields are rejected."""
from __future__ import annotations

import random
from typing import Annotated, Literal

from pydantic import AwareDatetime, BaseModel, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from worker.embedder.params import EmbedParams
from worker.engine.sampling_params import SamplingParams, per_item
from jobs.spec import CONTENT_TAGS, KINDS, JobInput, JobSpec, Task

from .tenants import LIMITS

Priority = Literal["high", "normal", "low"]
Status = Literal["validating", "queued", "scheduled", "running", "succeeded", "failed", "canceled"]
MetadataKey = Annotated[str, Field(min_length=1, max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]

# One object for every item, or a list with one per item. The tags are dropped from error
# locations (api.app) so an error reads body.sampling_params.top_p or body.sampling_params.2.n.
SamplingParamsField = Annotated[
    Annotated[SamplingParams, Tag("one")] | Annotated[list[SamplingParams], Tag("per_item")],
    Discriminator(lambda v: "per_item" if isinstance(v, list) else "one"),
]
UNION_TAGS = frozenset({"one", "per_item"}) | CONTENT_TAGS


class JobRequest(JobInput):
    """The body of POST /v1/jobs: the items (jobs.spec.JobInput) and how to run them;
    `sampling_params` is one object for all items or a list, one per item."""
    sampling_params: SamplingParamsField = Field(default_factory=SamplingParams)
    seed: int | None = Field(None, ge=0, lt=1 << 63, description=(
        "job seed: sample j of item i draws from (seed, i, j), unless the item's own "
        "sampling_params carry a seed; defaults to the seed of a shared sampling_params "
        "object, else a random seed returned in the response"))
    priority: Priority = "normal"
    metadata: dict[MetadataKey, MetadataValue] = Field(default_factory=dict, max_length=16, description=(
        "up to 16 string pairs (keys up to 64 characters, values up to 512), as OpenAI's "
        "batch metadata; stored and returned as is"))
    run_at: Annotated[AwareDatetime, Field(strict=False)] | None = Field(
        None, description="start no earlier than this (ISO 8601 with a zone)")
    input_file_id: str | None = Field(None, min_length=1, max_length=256, description=(
        "instead of items: a file uploaded with purpose `dataset`, one item per line (api/dataset.py); "
        "`sampling_params` is then one object, the lines' defaults"))

    input_url: str | None = Field(None, min_length=1, max_length=2048, description=(
        "instead of items: a dataset the API reads itself, `s3://` in the configured blob store or "
        "`file://` under FANOUT_INPUT_ROOT, JSONL or Parquet, as `input_file_id`'s"))
    task: Task = Field("generate", description=(
        "generate (the default): samples of text; embed: one vector per item (`prompts` or "
        "`input_ids`), on the workers of an embedding model, with `embed` instead of sampling_params"))
    embed: EmbedParams | None = Field(None, description="an embedding job's parameters (task embed)")
    model: str | None = Field(None, min_length=1, max_length=256, description=(
        "the served model to run on (GET /v1/models); optional while the fleet serves one model of the "
        "job's task. A model whose workers are away (or still loading) takes the job, which waits queued"))
    webhook_url: str | None = Field(None, min_length=1, max_length=2048, description=(
        "POSTed a signed event when the job ends (docs/api.md, Webhooks); a host FANOUT_WEBHOOK_HOSTS allows. "
        "Default: your default webhook (PUT /v1/webhooks), if any"))

    @property
    def input(self) -> str | None:
        """The field naming the dataset, if one does: input_file_id or input_url."""
        return "input_file_id" if self.input_file_id is not None else "input_url" if self.input_url is not None \
            else None

    @model_validator(mode="after")
    def _one_input(self):
        """Items, or a dataset of them (JobInput's check for the items)."""
        if self.task == "embed":
            self._embedding()
        elif self.embed is not None:
            raise ValueError("embed: only with task embed")
        if self.input is None:
            return JobInput._one_input(self)
        if self.input_file_id is not None and self.input_url is not None:
            raise ValueError("give input_file_id or input_url, not both")
        given = [k for k in (*KINDS, "custom_ids") if getattr(self, k) is not None]
        if given:
            raise ValueError(f"{self.input}: the items are the dataset's; give no {given[0]}")
        if isinstance(self.sampling_params, list):
            raise ValueError(f"sampling_params: one object with {self.input} (a line's own override it)")
        return self

    def _embedding(self) -> None:
        if self.messages is not None:
            raise ValueError("messages: an embedding job (task embed) takes prompts or input_ids")
        if "sampling_params" in self.model_fields_set:
            raise ValueError("sampling_params: an embedding job (task embed) samples nothing; its "
                             "parameters are `embed`")
        if self.input is not None:
            raise ValueError(f"{self.input}: an embedding job takes its items in the request (datasets: "
                             "POST /v1/batches with the /v1/embeddings endpoint)")
        if self.embed is None:
            self.embed = EmbedParams()

    @field_validator("run_at")
    @classmethod
    def _after_epoch(cls, v):
        # rq schedules by Unix time: an earlier run_at would never come due.
        if v is not None and v.timestamp() < 0:
            raise ValueError("must be after 1970-01-01T00:00:00Z")
        return v

    @field_validator("sampling_params")
    @classmethod
    def _one_per_item(cls, v, info: ValidationInfo):
        items = next((info.data[k] for k in KINDS if info.data.get(k)), None)
        if isinstance(v, list) and items is not None and len(v) != len(items):
            raise ValueError(f"list has {len(v)} entries for {len(items)} items")
        return v

    def spec(self, seed: int | None = None) -> JobSpec:
        """The normalized job the worker runs. The job seed: `seed`, else this request's,
        else a shared sampling_params object's, else a random one."""
        params, job_seed = per_item(self.sampling_params, self.size, seed if seed is not None else self.seed)
        if job_seed is None:
            job_seed = random.getrandbits(63)
        # Every part was validated with this request: not validated again (10,000 items, 18 ms).
        return JobSpec.model_construct(**{self.kind: self.items}, custom_ids=self.custom_ids,
                                       sampling_params=params, seed=job_seed, task=self.task, embed=self.embed)


class JobCreated(BaseModel):
    id: str
    status: Status
    stream: str = Field(description="Redis stream key of the job's events (XREAD it, or use /events)")
    seed: int
    items: int | None = Field(description="the job's item count; null while a dataset is validating")


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


class Shards(BaseModel):
    total: int = Field(description="shards the job was cut into (FANOUT_SHARD_SAMPLES samples each, whole items)")
    queued: int = Field(description="in the queue, for any worker to take")
    running: int = Field(description="held by a worker now")
    done: int = Field(description="ended")
    pending: int = Field(description="not queued yet: a job keeps FANOUT_SHARD_WINDOW queued at a time")
    workers: list[str] = Field(description="the workers running its shards now")


class Webhook(BaseModel):
    url: str
    status: Literal["pending", "delivered", "failed"] = Field(description=(
        "pending until the job ends and a delivery got a 2xx (delivered), or every attempt failed (failed)"))
    attempts: int = Field(description="deliveries tried so far")
    error: str | None = Field(description="why the last attempt failed (null after a 2xx)")


class JobInfo(BaseModel):
    id: str
    status: Status
    priority: Priority
    task: Task = Field(description="generate, or embed: an embedding job (one vector per item)")
    progress: Progress
    usage: Usage = Field(description="summed over samples")
    error: str | None
    errors: list[dict] | None = Field(None, description=(
        "a dataset job that failed validation: the lines at fault, as a 422's `detail` names them"))
    seed: int
    attempt: int = Field(description="1 + the retries of its shards so far (a shard resumed after "
                                     "its worker died or handed it back counts one); 0 before any started")
    metadata: dict[str, str]
    model: str | None = Field(description="the model it runs on")
    waiting: str | None = Field(None, description=(
        "a queued job's reason not to run yet when no live worker serves its model (null otherwise)"))
    stream: str
    run_at: str | None
    created_at: str | None
    started_at: str | None
    ended_at: str | None
    batching: Batching
    shards: Shards
    webhook: Webhook | None = Field(None, description="its webhook and how its delivery went (null: none)")


class TopLogprob(BaseModel):
    token_id: int
    token: str = Field(description="the token decoded alone")
    logprob: float


class TokenLogprob(TopLogprob):
    """One generated token: the log_softmax of the model's raw logits (before penalties,
    temperature and filters) at its position."""
    top_logprobs: list[TopLogprob] = Field(description="the `top_logprobs` most likely tokens, best first")


class PromptTokenLogprob(BaseModel):
    """One prompt token, scored given the tokens before it (teacher forcing)."""
    token_id: int
    token: str = Field(description="the token decoded alone")
    logprob: float | None = Field(description="null for the prompt's first token (nothing comes before it)")
    top_logprobs: list[TopLogprob] | None = Field(description="the `prompt_logprobs` most likely tokens "
                                                               "at its position, best first; null for the first")


class ParsedCall(BaseModel):
    name: str
    arguments: str = Field(description="JSON text of the arguments object")


class SampleOut(BaseModel):
    sample: int
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    error: str | None
    logprobs: list[TokenLogprob] | None = Field(
        None, description="one per token of token_ids; null unless the sample asked (`logprobs: true`)")
    prompt_logprobs: list[PromptTokenLogprob] | None = Field(
        None, description="one per prompt token; null unless the item asked (`prompt_logprobs: k`)")
    tool_calls: list[ParsedCall] | None = Field(
        None, description="a chat item with tools: the calls parsed out of `text` ([] for none); else null")
    content: str | None = Field(None, description="a chat item with tools: the text that is not a call")
    embedding: list[float] | None = Field(None, description="an embedding job's vector (float32 values)")


class ItemOut(BaseModel):
    index: int
    custom_id: str | None = Field(description="the item's custom_id, if it was given one")
    samples: list[SampleOut] = Field(description="finished samples so far, by sample index")


class ResultsPage(BaseModel):
    id: str
    status: Status
    offset: int
    limit: int
    total: int
    next_offset: int | None
    items: list[ItemOut]


class JobList(BaseModel):
    data: list[JobInfo] = Field(description="newest first")
    has_more: bool
    last_id: str | None = Field(description="pass it as `after` for the next page")


class Canceled(BaseModel):
    id: str
    status: Status


class ErrorOut(BaseModel):
    detail: str


class LimitOut(ErrorOut):
    limit: Literal[tuple(LIMITS)] = Field(
        description="the API key's limit that was hit (`fanout keys list` shows them)")


class Health(BaseModel):
    status: Literal["ok"]
    redis: str


class Version(BaseModel):
    version: str
