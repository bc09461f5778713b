"""OpenAI's request and response objects for chat completions, completions and models, and
the mapping of OpenAI's sampling names onto SamplingParams (the one definition of each
parameter: the request fields take its type, bounds and description).

A field OpenAI has and we do not (logit_bias, ...) is an unknown field here:
400 naming it (api.openai.errors), never ignored."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from worker.engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams, StopString, TokenId
from jobs.settings import Settings
from jobs.spec import ImagePart, ImageURL, Message, NonEmptyStr, content_type

from ..schemas import MetadataKey, MetadataValue, Priority, PromptTokenLogprob
from .errors import OpenAIError

# OpenAI name -> SamplingParams name: the one place where the two vocabularies meet.
SAMPLING = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "n": "n",
            "seed": "seed", "stop": "stop", "temperature": "temperature", "top_p": "top_p",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# Extensions, as vLLM takes them: the engine's other parameters.
EXTENSIONS = {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
              "min_tokens": "min_new_tokens", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
              "skip_special_tokens": "skip_special_tokens", "regex": "regex", "choice": "choice",
              "prompt_logprobs": "prompt_logprobs"}
CHAT_LOGPROBS = {"logprobs": "logprobs", "top_logprobs": "top_logprobs"}  # completions: `logprobs: k`
TOOLS = {"tools": "tools", "tool_choice": "tool_choice", "parallel_tool_calls": "parallel_tool_calls"}  # chat


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _field(ours: str) -> tuple[Any, Any]:
    f = SamplingParams.model_fields[ours]
    kind = Annotated[f.annotation, *f.metadata] if f.metadata else f.annotation
    if ours == "stop":
        kind = StopString | kind  # one string or a list, as in SamplingParams
    return Optional[kind], Field(None, description=f.description)


def _fields(table: dict[str, str]) -> dict[str, tuple]:
    return {theirs: _field(ours) for theirs, ours in table.items()}


class StreamOptions(Strict):
    include_usage: bool = Field(False, description="a last chunk with the usage and no choices")


class JsonSchemaFormat(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(None, max_length=4096)
    schema_: dict[str, Any] | None = Field(None, alias="schema", description=(
        "the JSON Schema of the output (SamplingParams.json_schema); absent: any JSON"))
    strict: bool | None = Field(None, description="taken as true: the output always follows the schema")


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema only")

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: give it with type json_schema, and only then")
        return self


class Request(Strict):
    model: str = Field(min_length=1, description="a model that GET /v1/models lists")
    stream: bool = Field(False, description="server-sent chunks, then `data: [DONE]`")
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = Field(None, description=(
        "json_object or json_schema: the output's grammar (see also the regex and choice extensions)"))
    user: str | None = Field(None, max_length=512, description="kept in the job's metadata as `user`")
    # Accepted and without effect on the output (NO_OPS): what clients send by default.
    store: bool | None = Field(None, description="no effect: nothing is kept for OpenAI's evals or distillation "
                                                 "(the job's results expire as every job's)")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="no effect: one tier (interactive requests already pass batch work)")
    safety_identifier: str | None = Field(None, max_length=512, description="no effect")
    prompt_cache_key: str | None = Field(None, max_length=512, description=(
        "no effect: the radix cache finds shared prefixes by their tokens"))
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=15, description=(
        "kept in the job's metadata (15 pairs: `user` may take the 16th)"))


class ChatImageURL(ImageURL):
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted and ignored")


class ChatImagePart(ImagePart):
    image_url: ChatImageURL


class ChatMessage(Message):
    """A request's message: the job's Message (tool calls and all) whose image parts may
    carry `detail`."""
    content: content_type(ChatImagePart) | None = Field(description=(
        "text, or parts: text parts (joined) and image_url parts (data URLs; for a model that "
        "takes images); null only in an assistant message with tool_calls"))

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def image_parts(self) -> list[int]:
        """Positions of the image parts in the content."""
        return [] if not isinstance(self.content, list) else [
            j for j, p in enumerate(self.content) if p.type == "image_url"]

    def job_message(self) -> Message:
        """The job's message: text-only content joined into one string (as before images),
        else the parts as given (`detail` dropped)."""
        tools = {"tool_calls": self.tool_calls, "tool_call_id": self.tool_call_id}
        if not self.image_parts():
            return Message(role=self.role, content=None if self.content is None else self.text(), **tools)
        return Message.model_validate({"role": self.role, **tools, "content": [
            {"type": "text", "text": p.text} if p.type == "text"
            else {"type": "image_url", "image_url": {"url": p.image_url.url}} for p in self.content]})


def image_error(messages: list[ChatMessage], model: str, schemes: list[str]) -> tuple[str, str] | None:
    """(param, message) for the first image part that `model`'s workers cannot take (a text
    model takes none; the others, the URL schemes they announce), e.g. param
    messages[0].content[1]; None when they take every one."""
    for i, m in enumerate(messages):
        for j in m.image_parts():
            name = f"messages[{i}].content[{j}]"
            if not schemes:
                return name, f"{name}: image_url parts are not supported by the model '{model}' (it takes text only)"
            scheme = m.content[j].image_url.url.partition(":")[0].lower()
            if scheme not in schemes:
                return (f"{name}.image_url.url", f"{name}.image_url.url: {scheme} URLs are not taken by the "
                        f"workers of the model '{model}' (they take {', '.join(schemes)})")
    return None


ChatCompletionRequest = create_model(
    "ChatCompletionRequest", __base__=Request,
    messages=(list[ChatMessage], Field(min_length=1, description="templated by the model's chat template")),
    **_fields({**SAMPLING, **EXTENSIONS, **CHAT_LOGPROBS, **TOOLS}))

Prompt = (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
          | Annotated[list[TokenId], Field(min_length=1)]
          | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])

CompletionRequest = create_model(
    "CompletionRequest", __base__=Request,
    prompt=(Prompt, Field(description="a text, texts, token ids, or lists of token ids: one job item each")),
    logprobs=(Optional[Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]],
              Field(None, description="the log-probability of each token and of the k most likely")),
    echo=(bool, Field(False, description=(
        "the prompt comes first in the text; with logprobs, its tokens and their logprobs too "
        "(the first's null), as scoring clients ask (`max_tokens: 0`: the prompt alone). Not "
        "with `stream`, nor in batch lines (ask `prompt_logprobs` there)"))),
    **_fields({**SAMPLING, **EXTENSIONS}))


def sampling_params(req: Request, settings: Settings) -> SamplingParams:
    """The request's sampling fields as SamplingParams, within the service's limits. Without
    max_tokens a chat completion may run to FANOUT_MAX_NEW_TOKENS (or the end of the
    context) and a completion to 16 tokens, as OpenAI's defaults."""
    table = {**SAMPLING, **EXTENSIONS, **({**CHAT_LOGPROBS, **TOOLS} if isinstance(req, ChatCompletionRequest) else {})}
    given = {ours: getattr(req, theirs) for theirs, ours in table.items() if getattr(req, theirs) is not None}
    if isinstance(req, CompletionRequest) and req.logprobs is not None:
        given.update(logprobs=True, top_logprobs=req.logprobs)
        if req.echo:
            given.setdefault("prompt_logprobs", req.logprobs)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given["json_object"] = True
    elif fmt is not None and fmt.type == "json_schema":
        given["json_schema"] = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}

    def named(ours: str) -> str:
        if ours in ("json_schema", "json_object"):
            return "response_format"
        return next((t for t, o in table.items() if o == ours and getattr(req, t) is not None), ours)

    given.setdefault("max_new_tokens", 16 if isinstance(req, CompletionRequest) else settings.max_new_tokens)
    try:
        p = SamplingParams(**given)
    except ValidationError as e:
        err = e.errors()[0]
        if err["loc"]:
            name = named(err["loc"][0])
            raise OpenAIError(400, f"{name}: {err['msg']}", param=name, code="invalid_value") from None
        # A check across fields: its message starts with the field it is about.
        msg = err["msg"].removeprefix("Value error, ")
        field = msg.partition(":")[0]
        name = named(field) if field in SamplingParams.model_fields else None
        raise OpenAIError(400, msg, param=name, code="invalid_value") from None
    if isinstance(req, CompletionRequest) and req.echo and req.stream:
        raise OpenAIError(400, "echo: not with stream: true (the prompt's logprobs come with the whole "
                               "sample); ask without stream", param="echo", code="unsupported_parameter")
    if p.max_new_tokens > settings.max_new_tokens:
        raise OpenAIError(400, f"{p.max_new_tokens} tokens is over this server's limit of {settings.max_new_tokens} "
                               "(FANOUT_MAX_NEW_TOKENS)", param=named("max_new_tokens"), code="invalid_value")
    if p.n > settings.max_n:
        raise OpenAIError(400, f"n={p.n} is over this server's limit of {settings.max_n} (FANOUT_MAX_N)",
                          param="n", code="invalid_value")
    return p


# -- responses ---------------------------------------------------------------------------

class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="when a worker started serving it (Unix seconds)")
    owned_by: str = "fanout"
    root: str = Field(description="the model it is (here: its id, as vLLM answers for a base model)")
    parent: str | None = Field(None, description="a LoRA adapter's base model (vLLM's field); null for a base model")
    max_model_len: int | None = Field(None, description="its context length in tokens (prompt + output)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class LegacyLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for the first prompt token, with echo")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="JSON text; under tool_choice required or a named function, "
                                       "always valid for the function's parameters")


class MessageToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="null when the answer is tool calls alone")
    refusal: None = None
    tool_calls: list[MessageToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str
    prompt_logprobs: list[PromptTokenLogprob] | None = Field(None, description=(
        "extension (`prompt_logprobs: k`): each token's logprob in the templated chat"))


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    system_fingerprint: None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: LegacyLogprobs | None
    finish_reason: str
    prompt_logprobs: list[PromptTokenLogprob] | None = Field(None, description=(
        "extension (`prompt_logprobs: k`): each prompt token's logprob given the tokens before it"))


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage
    system_fingerprint: None = None


# -- files and batches --------------------------------------------------------------------

class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output", "dataset"] = Field(description=(
        "`dataset` (extension): a native job's items, named by POST /v1/jobs `input_file_id`"))
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"]


class BatchCreate(Strict):
    input_file_id: str = Field(description="a file uploaded with purpose `batch`")
    endpoint: Endpoint
    completion_window: Literal["24h"] = Field(description="lines not done by then expire (FANOUT_BATCH_WINDOW)")
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)
    # Extensions, as in POST /v1/jobs.
    priority: Priority = Field("normal", description="extension: the job's queue")
    run_at: Annotated[AwareDatetime, Field(strict=False)] | None = Field(None, description="extension: start no earlier than this (ISO 8601 "
                                                           "with a zone); the window counts from creation")
    webhook_url: str | None = Field(None, min_length=1, max_length=2048, description=(
        "extension: POSTed a signed `batch.completed` (`.failed`, `.expired`, `.cancelled`) event when the batch "
        "ends (docs/api.md, Webhooks); default: your default webhook"))


class BatchError(BaseModel):
    code: str | None
    line: int | None
    message: str | None
    param: str | None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                    "cancelled"]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    usage: BatchUsage | None
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool
