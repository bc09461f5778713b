"""Sampling parameters: the one definition of each (name, type, default, bounds, doc).

The engine uses this model; the HTTP API uses it as its request schema and the CLI builds
its flags from its fields, so they cannot drift. Names follow SGLang. Constructing one
validates it: a bad value raises pydantic's ValidationError (a ValueError) naming the field.
This module imports no torch: the API imports it.
"""
from __future__ import annotations

import functools
import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from . import tools
from .tools import MAX_TOOLS, NamedChoice, Tool, ToolChoice

MAX_TOKENS = 1 << 20  # bound of every token count; the service sets lower limits (FANOUT_MAX_*)
MAX_TOKEN_ID = (1 << 31) - 1
MAX_TOP_LOGPROBS = 20  # as OpenAI
MAX_GRAMMAR_CHARS = 1 << 16  # a JSON schema (as JSON text), a regex, or all choices together
MAX_CHOICES = 1024

StopString = Annotated[str, Field(min_length=1, max_length=1024)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Choice = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
GRAMMAR_FIELDS = ("json_schema", "json_object", "regex", "choice")


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
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "the log-probability of each prompt token given the ones before it (the first has none), "
        "with the k most likely tokens at each position; 0: the token's alone. With "
        "max_new_tokens 0, a scoring item: nothing is generated"))
    skip_special_tokens: bool = Field(True, description="leave special tokens out of the text")
    # Constrained decoding (at most one of these): each token is drawn from what the grammar
    # allows, then EOS once it is complete, whatever ignore_eos says.
    json_schema: dict[str, Any] | str | None = Field(None, description=(
        "the output is JSON valid under this JSON Schema (an object, or its JSON text)"))
    json_object: bool = Field(False, description="the output is a JSON object")
    regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS, description=(
        "the output matches this regular expression in full (Rust regex syntax)"))
    choice: list[Choice] = Field([], max_length=MAX_CHOICES, description="the output is one of these strings")
    # Tool calling (tools.py): chat items only.
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description=(
        "functions the model may call: rendered by the chat template; the calls come back "
        "parsed (`tool_calls`)"))
    tool_choice: ToolChoice | None = Field(None, description=(
        "none, auto (the default with tools: the model's own format, parsed), required (one "
        "or more calls, decoded under their schemas) or {type: function, function: {name}}"))
    parallel_tool_calls: bool = Field(True, description="more than one call in an answer (required / auto)")

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("json_schema")
    @classmethod
    def _schema(cls, v):
        if v is None:
            return v
        if isinstance(v, str):
            if len(v) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"over {MAX_GRAMMAR_CHARS} characters")
            try:
                obj = json.loads(v)
            except ValueError as e:
                raise ValueError(f"not JSON: {e}") from None
            if not isinstance(obj, dict):
                raise ValueError("must be a JSON object")
        _check_schema(json.loads(v) if isinstance(v, str) else v)
        return v

    @field_validator("regex")
    @classmethod
    def _regex(cls, v):
        if v is not None:
            _check_grammar("regex", v)
        return v

    @field_validator("choice")
    @classmethod
    def _choice(cls, v):
        if sum(map(len, v)) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"over {MAX_GRAMMAR_CHARS} characters together")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError("min_new_tokens: must be <= max_new_tokens")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        given = [f for f in GRAMMAR_FIELDS if getattr(self, f) not in (None, False, [])]
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if isinstance(choice, NamedChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice: no tool is named {choice.function.name!r}")
        if self.tools and len({t.function.name for t in self.tools}) < len(self.tools):
            raise ValueError("tools: two functions have the same name")
        if (calls := self.tool_schema) is not None:
            given.append("tool_choice")
            try:
                _check_schema(calls)
            except ValueError as e:
                raise ValueError(f"tools: a function's parameters: {e}") from None
        if len(given) > 1:
            raise ValueError(f"{', '.join(given)}: give at most one")
        if given and self.min_new_tokens:
            # Once the grammar is complete only EOS is allowed, and min_new_tokens forbids it.
            raise ValueError(f"min_new_tokens: cannot be combined with {given[0]}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def effective_tool_choice(self):
        """tool_choice as it applies: auto when tools are given without one, else none."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def tool_schema(self) -> dict | None:
        """The output's schema under tool_choice required / a named function (tools.py)."""
        if not self.tools:
            return None
        return tools.schema(self.tools, self.effective_tool_choice, self.parallel_tool_calls)

    def grammar_on(self, tool_format: str | None) -> tuple[str, str] | None:
        """The grammar on a model whose template has `tool_format` (tools.format_of): under
        tool_choice auto the generic format's schema where the template has no format of
        its own, else `grammar`."""
        if self.tools and tool_format == "generic" and self.effective_tool_choice == "auto":
            return "json_schema", _canonical(tools.generic_schema(self.tools, self.parallel_tool_calls))
        return self.grammar

    @property
    def grammar(self) -> tuple[str, str] | None:
        """The output constraint as (kind, canonical text), the key of the engine's compile
        cache: ("json_schema", compact JSON text; json_object is the schema of any object),
        ("regex", the regex) or ("choice", the choices as a JSON list); None without one."""
        if self.json_schema is not None:
            return "json_schema", _canonical(self.json_schema)
        if (calls := self.tool_schema) is not None:
            return "json_schema", _canonical(calls)
        if self.json_object:
            return "json_schema", '{"type":"object"}'
        if self.regex is not None:
            return "regex", self.regex
        if self.choice:
            return "choice", json.dumps(self.choice, ensure_ascii=False)
        return None

    def copy(self, **changes) -> "SamplingParams":
        """A validated copy with some fields changed."""
        return SamplingParams.model_validate({**self.model_dump(), **changes})


def _check_schema(schema: dict) -> None:
    """ValueError unless `schema` is a JSON Schema the grammar libraries compile (json_schema,
    or the one tool calls are decoded under)."""
    if len(_canonical(schema)) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"over {MAX_GRAMMAR_CHARS} characters as JSON")
    loop = _ref_loop(schema)
    if loop is not None:
        raise ValueError(f"$ref {loop!r} leads back to itself through references alone: no value "
                         "can match it")
    _check_grammar("json_schema", _canonical(schema))


def _canonical(schema: dict | str) -> str:
    """Compact JSON text of a schema. Key order is kept: it is the order of the output's
    properties."""
    obj = json.loads(schema) if isinstance(schema, str) else schema
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:  # from Python: a set, a NaN...
        raise ValueError(f"not JSON: {e}") from None


def llguidance_grammar(kind: str, text: str) -> str:
    """llguidance's grammar for (kind, text) (see SamplingParams.grammar). JSON comes out
    compact, as xgrammar writes it (a schema's own x-guidance options still apply)."""
    import llguidance

    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    return llguidance.grammar_from("choice", text)


# Keywords that add nothing a value must match: a schema of these and a $ref is an alias.
_ANNOTATIONS = frozenset({"$ref", "$id", "$schema", "$comment", "$defs", "definitions", "title", "description",
                          "default", "examples", "deprecated", "readOnly", "writeOnly"})
_DATA = frozenset({"enum", "const", "default", "examples"})  # values, not schemas: not looked into


def _ref_loop(schema: dict) -> str | None:
    """A local $ref that comes back to where it started through aliases alone ({"$ref": "#"},
    or two $defs naming each other): no value matches it, and the grammar libraries answer
    it with an empty output that 'stops'. Returns that $ref, or None."""
    def resolve(ref: str):
        node = schema
        for part in ref[1:].lstrip("/").split("/") if ref not in ("#", "#/") else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        stack.extend(v for k, v in node.items() if k not in _DATA)
        seen, n = set(), node
        while isinstance(n, dict) and isinstance(n.get("$ref"), str) and n["$ref"].startswith("#") \
                and set(n) <= _ANNOTATIONS:
            if id(n) in seen:
                return node["$ref"]
            seen.add(id(n))
            n = resolve(n["$ref"])
    return None


def _check_grammar(kind: str, text: str) -> None:
    """Raise ValueError with llguidance's message if it cannot compile the grammar. It needs
    no tokenizer and no torch, so the API checks every grammar at submit time; the engine
    compiles with xgrammar first and falls back to llguidance, so what passes here compiles
    there (its tokenizer aside)."""
    error = _grammar_error(kind, text)
    if error:
        raise ValueError(error)


@functools.lru_cache(maxsize=1024)  # 10,000 items with one schema check it once
def _grammar_error(kind: str, text: str) -> str | None:
    import llguidance

    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(llguidance_grammar(kind, text))
    return messages[0] if error else None


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
