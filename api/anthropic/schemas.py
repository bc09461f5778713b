"""Anthropic's Messages request, and what it becomes: one chat item (the job's messages,
OpenAI-shaped: jobs.spec.Message) and its SamplingParams.

Blocks: `text`; `image` (a base64 source becomes a data URL, a url source the URL: the
model's workers must take it); an assistant's `tool_use` (a tool call whose id is kept); a
user's `tool_result` (a tool message answering that id, placed before the rest of the turn).
`cache_control` is accepted and changes nothing (the radix cache finds shared prefixes by
their tokens). Tools are Anthropic's `{name, description, input_schema}`; tool_choice
`auto`, `any` (our `required`), `tool` (a named function) and `none`;
`disable_parallel_tool_use` is parallel_tool_calls false. `output_config.format` (a JSON
Schema) is the answer's grammar. The 2.x SDK has no sampling arguments of its own:
`temperature` (default 1), `top_p` and `top_k` are taken from the body (`extra_body`).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jobs.settings import Settings
from jobs.spec import Message
from worker.engine.sampling_params import SamplingParams

from .errors import AnthropicError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = Field(None, description="accepted and ignored")


class Base64Source(_Strict):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)


class URLSource(_Strict):
    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlock(_Strict):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    def url(self) -> str:
        s = self.source
        return s.url if isinstance(s, URLSource) else f"data:{s.media_type};base64,{s.data}"


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        if any(isinstance(b, ImageBlock) for b in self.content):
            raise ValueError("a tool_result with an image: not taken (give its text)")
        return "".join(b.text for b in self.content)


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1)]


class AnthropicTool(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description="with type tool")
    disable_parallel_tool_use: bool | None = None


class JSONOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: JSONOutputFormat | None = Field(None, description="structured output: the answer decoded under this "
                                                              "JSON Schema")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="no effect: the models served here have no effort setting")


class Metadata(_Strict):
    user_id: str | None = Field(None, max_length=512)


class MessagesRequest(_Strict):
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="no effect: one tier")
    cache_control: CacheControl | None = Field(None, description="no effect: the radix cache finds shared "
                                                                 "prefixes by their tokens")

    def chat(self) -> list[dict]:
        """The job's chat: the system text first, then each turn (jobs.spec.Message's shape)."""
        out = []
        if self.system:
            text = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": text})
        for i, m in enumerate(self.messages):
            try:
                out += _turn(m)
            except ValueError as e:
                raise AnthropicError(400, f"messages.{i}.content: {e}") from None
        for i, m in enumerate(out):
            try:
                Message.model_validate(m)
            except ValidationError as e:
                raise AnthropicError(400, f"messages: {e.errors()[0]['msg']}") from None
        return out

    def sampling_params(self, settings: Settings) -> SamplingParams:
        given: dict[str, Any] = {"max_new_tokens": self.max_tokens,
                                 "temperature": 1.0 if self.temperature is None else self.temperature}
        if self.top_p is not None:
            given["top_p"] = self.top_p
        if self.top_k is not None:
            given["top_k"] = self.top_k
        if self.stop_sequences:
            given["stop"] = self.stop_sequences
        if self.output_config is not None and self.output_config.format is not None:
            given["json_schema"] = self.output_config.format.schema_
        if self.tools:
            given["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                                "parameters": t.input_schema}} for t in self.tools]
            choice = self.tool_choice
            if choice is not None:
                if choice.type == "tool":
                    if not choice.name:
                        raise AnthropicError(400, "tool_choice.name: required with type tool")
                    given["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
                else:
                    given["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
                if choice.disable_parallel_tool_use:
                    given["parallel_tool_calls"] = False
        elif self.tool_choice is not None and self.tool_choice.type != "none":
            raise AnthropicError(400, "tool_choice: needs tools")
        if self.max_tokens > settings.max_new_tokens:
            raise AnthropicError(400, f"max_tokens: {self.max_tokens} is over this server's limit of "
                                      f"{settings.max_new_tokens} (FANOUT_MAX_NEW_TOKENS)")
        try:
            return SamplingParams(**given)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            raise AnthropicError(400, f"{where}: {msg}" if where else msg) from None


def _turn(m: InputMessage) -> list[dict]:
    """One Anthropic turn as the job's messages: a user turn's tool results first (tool
    messages), then its text and images; an assistant turn's text and tool calls."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    parts, calls, results = [], [], []
    for b in m.content:
        if isinstance(b, TextBlock):
            parts.append({"type": "text", "text": b.text})
        elif isinstance(b, ImageBlock):
            if m.role == "assistant":
                raise ValueError("an image block: only in a user turn")
            parts.append({"type": "image_url", "image_url": {"url": b.url()}})
        elif isinstance(b, ToolUseBlock):
            if m.role != "assistant":
                raise ValueError("a tool_use block: only in an assistant turn")
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
        else:
            if m.role != "user":
                raise ValueError("a tool_result block: only in a user turn")
            results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": ("Error: " if b.is_error else "") + b.text()})
    out = list(results)
    if m.role == "assistant":
        text = "".join(p["text"] for p in parts)
        out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
    elif parts:
        images = any(p["type"] == "image_url" for p in parts)
        out.append({"role": "user", "content": parts if images else "".join(p["text"] for p in parts)})
    return out


# -- responses ---------------------------------------------------------------------------

class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = 0
    cache_read_input_tokens: int | None = 0


class Message_(BaseModel):
    """The `message` object (the response of POST /v1/messages)."""
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def message(id: str, model: str, record: dict) -> dict:
    """A sample record (results.store.sample_record) as Anthropic's message object."""
    calls = record.get("tool_calls") or []
    text = record.get("content") if record.get("tool_calls") is not None else record["text"]
    content = [{"type": "text", "text": text}] if text else []
    for k, c in enumerate(calls):
        content.append({"type": "tool_use", "id": tool_use_id(id, k), "name": c["name"],
                        "input": json.loads(c["arguments"])})
    stop = record.get("stop")
    if calls:
        reason = "tool_use"
    elif record["finish_reason"] == "length":
        reason = "max_tokens"
    else:
        reason = "stop_sequence" if stop is not None else "end_turn"
    u = record["usage"]
    return Message_(id=id, model=model, content=content, stop_reason=reason, stop_sequence=stop,
                    usage=AnthropicUsage(input_tokens=u["prompt_tokens"], output_tokens=u["completion_tokens"],
                                cache_read_input_tokens=u.get("cached_tokens", 0))).model_dump()


def tool_use_id(message_id: str, k: int) -> str:
    """The k-th call's id: made from the message's, so a retried attempt gives the same."""
    return f"toolu_{message_id.removeprefix('msg_')}_{k}"
