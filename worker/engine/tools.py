"""Tool calling: the tools a chat item offers (OpenAI's `tools`, `tool_choice`,
`parallel_tool_calls`), the grammar that makes `required` and a named function always
valid, and the parsers that read the calls out of a model's own tool format for `auto`.

- The chat template renders the tools (HF's `tools=` argument) and the assistant's earlier
  `tool_calls` and `tool` messages, as the model was trained.
- `required`: the output is a JSON array of `{"name", "arguments"}`, one or more (one without
  parallel calls), each `arguments` valid for its function's `parameters`; a named function:
  the output is that function's arguments. Both are decoded under that JSON Schema, so the
  calls always parse and validate.
- `auto`: the model writes calls in its template's format or answers in text. Formats known
  (`FORMATS`, told from the template's text): `hermes`, `<tool_call>{"name", "arguments"}
  </tool_call>` (Qwen2.5, Qwen3, Hermes 2/3, QwQ); `llama3_json`, a JSON object `{"name",
  "parameters"}` as the whole answer, maybe after `<|python_tag|>`, several joined by `;`
  (Llama 3.1, 3.2, 3.3). A template with neither has no tool format: `auto` is refused.

No torch here: the API imports it to validate requests.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 128  # as OpenAI
FORMATS = ("hermes", "llama3_json")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class Function(_Strict):
    name: FunctionName
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of its arguments object; "
                                                                "absent: no arguments")
    strict: bool | None = Field(None, description="taken as true under required / a named choice")


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class FunctionRef(_Strict):
    name: FunctionName


class NamedChoice(_Strict):
    type: Literal["function"]
    function: FunctionRef


ToolChoice = Literal["none", "auto", "required"] | NamedChoice


def parameters(f: Function) -> dict:
    return f.parameters if f.parameters is not None else {"type": "object", "properties": {}}


def schema(tools: list[Tool], choice, parallel: bool) -> dict | None:
    """The output's JSON Schema under `required` or a named function; None otherwise."""
    if isinstance(choice, NamedChoice):
        return parameters(next(t.function for t in tools if t.function.name == choice.function.name))
    if choice != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": parameters(t.function)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    out = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        out["maxItems"] = 1
    return out


def format_of(template: str | None) -> str | None:
    """The tool format a chat template's text shows (`FORMATS`), or None."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters": dictionary of argument name' in template:
        return "llama3_json"
    return None


def _call(obj: Any, names: set[str], key: str) -> dict | None:
    if not (isinstance(obj, dict) and obj.get("name") in names):
        return None
    args = obj.get(key, {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = _loads.decode(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
# Control characters inside strings are taken (the JSON grammars let them through); the
# arguments are written out again escaped.
_loads = json.JSONDecoder(strict=False)


def parse(text: str, fmt: str | None, tools: list[Tool], choice) -> tuple[str | None, list[dict]]:
    """(content, calls) of an output: calls are {"name", "arguments" (JSON text)}. Under
    required / a named function the output is the grammar's JSON; under auto, the model's
    format (text that is not a well-formed call of a given function stays content)."""
    names = {t.function.name for t in tools}
    if isinstance(choice, NamedChoice):
        call = _call({"name": choice.function.name, "arguments": text}, names, "arguments")
        return (None, [call]) if call is not None else (text, [])
    if choice == "required":
        try:
            got = [_call(c, names, "arguments") for c in _loads.decode(text)]
        except (ValueError, TypeError):  # cut by max_tokens before the JSON closed
            return text, []
        return None, [c for c in got if c is not None]
    if choice == "none" or fmt is None:
        return text, []
    if fmt == "hermes":
        found = list(_HERMES.finditer(text))
        calls = []
        for m in found:
            try:
                calls.append(_call(_loads.decode(m.group(1)), names, "arguments"))
            except ValueError:
                calls.append(None)
        if not found or None in calls:
            return text, []
        content = text[:found[0].start()].strip()
        return content or None, calls
    body, at, calls = text.strip().removeprefix("<|python_tag|>"), 0, []  # llama3_json
    while True:  # objects, ";" (and spaces) between
        while at < len(body) and (body[at].isspace() or (calls and body[at] == ";")):
            at += 1
        if at == len(body):
            break
        try:
            obj, at = _loads.raw_decode(body, at)
        except ValueError:
            return text, []
        calls.append(_call(obj, names, "parameters"))
    if not calls or None in calls:
        return text, []
    return None, calls
