"""The job contract between the API and the worker, defined once and imported by both.

The API validates the request and turns it into a `JobSpec` (sampling parameters
normalized to one per item, the job seed fixed). The job is cut into shards (`plan`) and
its items go to Redis as JSON entries (`layout`: one per item, the sampling parameters in
the job's info hash when all items share them), one list element per shard that travel as rq jobs (JSON
serializer, no pickles) naming `JOB_FUNC` with two keyword arguments, the job id and the
shard number (jobs/shards.py). A worker reads its shard's slice back as a `Shard` and
fails a payload that does not parse at once, without retry.

Like all of jobs/, it imports neither the web app nor the worker process, nor torch (the
sampling parameters and tool names are the engine's pure definitions).
"""
from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from worker.embedder.params import EmbedParams
from worker.engine.sampling_params import SamplingParams, TokenId
from worker.engine.tools import MAX_TOOLS, FunctionName

# A job's task: what kind of worker runs it (a model has one: jobs/models.py).
TASKS = ("generate", "embed")
Task = Literal["generate", "embed"]
PRIORITIES = ("high", "normal", "low")


def queue_name(model: str, priority: str) -> str:
    """The rq queue of a model's shards at one priority: every worker serving the model
    takes from its model's queues alone, high first (queues)."""
    return f"fanout:{model}:{priority}"


def queues(model: str) -> list[str]:
    """A model's queues, in the order its workers take from them."""
    return [queue_name(model, p) for p in PRIORITIES]


JOB_FUNC = "worker.consumer.fanout_job"

Kind = Literal["prompts", "input_ids", "messages"]
KINDS: tuple[str, ...] = ("prompts", "input_ids", "messages")
NonEmptyStr = Annotated[str, Field(min_length=1)]


def _unicode(v: str) -> str:
    """Text a tokenizer can take: no lone surrogate (JSON's \\ud800 escapes make them)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode: a lone surrogate U+{ord(v[e.start]):04X} at "
                         f"character {e.start}") from None
    return v


# A str inside a union is not checked for lone surrogates by pydantic as a plain one is.
Text = Annotated[str, AfterValidator(_unicode)]
CustomId = Annotated[str, Field(min_length=1, max_length=512)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class ImageURL(Strict):
    url: str = Field(min_length=1, description=(
        "data:image/<format>;base64,<data> (PNG, JPEG or WebP; bounded by the body limit, "
        "FANOUT_MAX_BODY_BYTES), or file:// and http(s):// URLs where the model's workers "
        "take them (off by default; the workers read them, the API never does)"))

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if v[:8].lower().startswith(("file://", "http://", "https://")):
            if len(v) > 4096:
                raise ValueError("a file or http(s) URL is at most 4096 characters")
            return v
        head, sep, _ = v[:256].partition(",")
        if not (sep and head.startswith("data:image/") and head.endswith(";base64")):
            raise ValueError("an image URL is data:image/<format>;base64,<data>, file:// or http(s)://")
        return v


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL


def _part_tag(v) -> str | None:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return {"text": "text_part", "image_url": "image_part"}.get(kind)


PART_ERROR = "a content part is {type: text, text} or {type: image_url, image_url: {url}}"


def _content_tag(v) -> str | None:
    return "string" if isinstance(v, str) else "parts" if isinstance(v, list) else None


def content_type(image_part: type[ImagePart] = ImagePart):
    """A message's content: a string, or a non-empty list of text parts and `image_part`s (the
    OpenAI surface passes its own, whose URL also takes `detail`). Error locations are tagged
    `string` / `parts` / `text_part` / `image_part`, which the API drops with CONTENT_TAGS, so
    one reads messages.0.0.content.1.image_url.url."""
    part = Annotated[Annotated[TextPart, Tag("text_part")] | Annotated[image_part, Tag("image_part")],
                     Discriminator(_part_tag, custom_error_type="content_part",
                                   custom_error_message=PART_ERROR)]
    parts = Annotated[list[part], Field(min_length=1)]
    return Annotated[Annotated[Text, Tag("string")] | Annotated[parts, Tag("parts")],
                     Discriminator(_content_tag, custom_error_type="content",
                                   custom_error_message="a content is a string or a list of parts")]


CONTENT_TAGS = frozenset({"string", "parts", "text_part", "image_part"})


Role = Literal["system", "developer", "user", "assistant", "tool"]  # OpenAI's


class CallFunction(Strict):
    name: FunctionName
    arguments: Text = Field(description="the arguments object as JSON text")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            ok = isinstance(json.loads(v), dict)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError("must be a JSON object's text")
        return v


class ToolCall(Strict):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: CallFunction


class Message(Strict):
    role: Role
    content: content_type() | None = Field(description=(
        "text, or a list of parts: {type: text, text} and {type: image_url, image_url: {url}} "
        "(data URLs; images need a model that takes them); null only in an assistant message "
        "with tool_calls"))
    tool_calls: Annotated[list[ToolCall], Field(min_length=1, max_length=MAX_TOOLS)] | None = Field(
        None, description="an assistant's earlier calls (tool calling)")
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        None, description="a tool message: the call it answers")

    @model_validator(mode="before")
    @classmethod
    def _calls_alone(cls, data):
        """An assistant's tool calls may come without content (clients drop a null one)."""
        if isinstance(data, dict) and data.get("tool_calls") and "content" not in data:
            return {**data, "content": None}
        return data

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only in an assistant message")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool_call_id: a tool message needs one, and only a tool message has one")
        if self.content is None and self.tool_calls is None:
            raise ValueError("content: null only in an assistant message with tool_calls")
        return self

    def chat_dict(self) -> dict:
        """The message as the engine takes it (chat.py): the fields it has."""
        return self.model_dump(mode="json", exclude_none=True)

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(p.type == "image_url" for p in self.content)


class JobInput(Strict):
    """The items of a job: exactly one of `prompts`, `input_ids`, `messages` (one chat per
    item, templated by the worker's tokenizer with the generation prompt; its images
    decoded by the engine, a bad one failing its item alone)."""
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
    """What a worker runs: the items, one SamplingParams per item, the job seed; its task,
    and for an embedding job (task "embed": texts or token ids, n = 1) its EmbedParams."""
    sampling_params: list[SamplingParams]
    seed: int = Field(ge=0, lt=1 << 63)
    task: Task = "generate"
    embed: EmbedParams | None = None

    @model_validator(mode="after")
    def _one_per_item(self):
        if len(self.sampling_params) != self.size:
            raise ValueError(f"sampling_params: {len(self.sampling_params)} for {self.size} items")
        if (self.embed is not None) != (self.task == "embed"):
            raise ValueError("embed: the parameters of an embedding job (task embed), and only of one")
        return self

    def layout(self) -> tuple[list[str], str | None]:
        """(one JSON entry per item, the sampling parameters all items share as JSON or
        None). Defaults are left out: a 100,000-item job stays small. An entry is
        {"x": item} plus "p": its sampling parameters when they are not shared (none in an
        embedding job's entries: they sample nothing)."""
        items = self.items  # texts and token ids are JSON as they are; chats are models
        if self.kind == "messages":
            items = self.model_dump(mode="json", include={self.kind})[self.kind]
        first = self.sampling_params[0]
        if all(p is first or p == first for p in self.sampling_params):
            # Formatted, not json.dumps of a dict: 10x faster on 100,000 items.
            return (['{"x":%s}' % json.dumps(x) for x in items],
                    json.dumps(first.model_dump(mode="json", exclude_defaults=True)))
        params = [p.model_dump(mode="json", exclude_defaults=True) for p in self.sampling_params]
        return [json.dumps({"x": x, "p": p}, separators=(",", ":")) for x, p in zip(items, params)], None


class Shard(JobSpec):
    """A slice of a job: its items [offset, offset + size), by global index."""
    offset: int = Field(0, ge=0)

    @classmethod
    def read(cls, kind: str, seed: int, shared: str | None, entries: str | bytes, custom_ids: list | None,
             offset: int, task: str = "generate", embed: str | None = None) -> "Shard":
        """The shard from the JSON array of its items' entries (JobSpec.layout) and its
        custom ids ("" for none; or, laid out by items.Builder, in the entries: "c")."""
        rows = json.loads(entries)
        if not isinstance(rows, list) or not all(isinstance(r, dict) and "x" in r for r in rows):
            raise ValueError("items: not a list of item entries")
        if not custom_ids and any("c" in r for r in rows):
            custom_ids = [r.get("c") for r in rows]
        common = json.loads(shared) if shared is not None else None
        return cls.model_validate({
            kind: [r["x"] for r in rows], "seed": seed, "offset": offset, "task": task,
            "embed": json.loads(embed) if embed is not None else None,
            "sampling_params": [common if common is not None else r.get("p", {}) for r in rows],
            "custom_ids": [(c.decode() if isinstance(c, bytes) else c) or None for c in custom_ids]
            if custom_ids else None})


class Cut:
    """plan's rule one item at a time (a dataset read line by line): add(n) tells whether
    the item starts a new shard."""

    def __init__(self, samples: int):
        self.samples, self.held = samples, 0

    def add(self, n: int) -> bool:
        new = bool(self.held) and self.held + n > self.samples
        self.held = (0 if new else self.held) + n
        return new


def plan(ns: list[int], samples: int) -> list[int]:
    """Shard bounds: shard k holds items [bounds[k], bounds[k + 1]). A shard takes items
    until their samples reach `samples`; an item is never split (one with more samples is
    a shard of its own)."""
    cut, bounds = Cut(samples), [0]
    for i, n in enumerate(ns):
        if cut.add(n):
            bounds.append(i)
    bounds.append(len(ns))
    return bounds
