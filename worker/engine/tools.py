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
  (Llama 3.1, 3.2, 3.3).
- `generic`: any other template (llama.cpp's generic tool handler is the model). The chat is
  rewritten before the template sees it (`generic_chat`): a system turn describes the tools
  and the answer's shape; the assistant's earlier calls become that shape's JSON, the tool
  results a user turn ("The result of NAME: ..."; as JSON, SmolLM2-135M called the tool
  again instead of answering). Under `auto` the output is decoded under
  `generic_schema`: `{"tool_call": {"name", "arguments"}}` (`"tool_calls": [...]` with
  parallel calls) or `{"response": "the answer"}`, so it always parses.

No torch here: the API imports it to validate requests.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 128  # as OpenAI
FORMATS = ("hermes", "llama3_json", "generic")


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
    out = {"type": "array", "minItems": 1, "items": _one_of([_call_schema(t.function) for t in tools])}
    if not parallel:
        out["maxItems"] = 1
    return out


def format_of(template: str | None) -> str | None:
    """The tool format of a chat template (`FORMATS`): the one its text shows, else
    generic; None without a template (no chats at all)."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters": dictionary of argument name' in template:
        return "llama3_json"
    return "generic"


def _call_schema(f: Function) -> dict:
    return {"type": "object", "properties": {"name": {"const": f.name}, "arguments": parameters(f)},
            "required": ["name", "arguments"], "additionalProperties": False}


def _one_of(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def generic_schema(tools: list[Tool], parallel: bool) -> dict:
    """The generic format's answer under auto: a call (calls, with parallel calls) of the
    given functions, or a plain response."""
    call = _one_of([_call_schema(t.function) for t in tools])
    key, value = ("tool_calls", {"type": "array", "minItems": 1, "items": call}) if parallel else ("tool_call", call)
    return {"anyOf": [{"type": "object", "properties": {key: value}, "required": [key], "additionalProperties": False},
                      {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                       "additionalProperties": False}]}


def _generic_instructions(tools: list[Tool], choice, parallel: bool) -> str:
    listed = json.dumps([{"name": t.function.name, "description": t.function.description,
                          "parameters": parameters(t.function)} for t in tools], ensure_ascii=False)
    if isinstance(choice, NamedChoice):
        shape = f"Answer with the JSON arguments object of a call to {choice.function.name}."
    elif choice == "required":
        shape = 'Answer with a JSON array of the calls to make: [{"name": "...", "arguments": {...}}].'
    elif parallel:
        shape = ('Answer in JSON: {"tool_calls": [{"name": "...", "arguments": {...}}]} to call tools, or '
                 '{"response": "..."} to answer the user. Once a tool\'s result answers the question, respond.')
    else:
        shape = ('Answer in JSON: {"tool_call": {"name": "...", "arguments": {...}}} to call a tool, or '
                 '{"response": "..."} to answer the user. Once a tool\'s result answers the question, respond.')
    return f"You can call these tools: {listed}\n{shape}"


def generic_chat(messages: list[dict], tools: list[Tool] | None, choice, parallel: bool) -> list[dict]:
    """The chat as a template without a tool format takes it (module docstring): the tools
    in a system turn (none under tool_choice none), earlier calls as the answer's JSON, the
    results of a turn's calls as one user turn."""
    names: dict[str, str] = {}  # tool call id -> its function's name
    out = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            names.update({c.get("id"): c["function"]["name"] for c in m["tool_calls"]})
            answer = {"tool_calls": calls} if parallel or len(calls) > 1 else {"tool_call": calls[0]}
            m = {"role": "assistant", "content": json.dumps(answer, ensure_ascii=False)}
        elif role == "tool":
            line = f"The result of {names.get(m.get('tool_call_id')) or 'the tool'}: {m.get('content') or ''}"
            if out and out[-1].get("_results"):  # the results of one turn's calls: one user turn
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{line}"}
                continue
            m = {"role": "user", "content": line, "_results": True}
        out.append(m)
    out = [{k: v for k, v in m.items() if k != "_results"} for m in out]
    if tools and choice != "none":
        text = _generic_instructions(tools, choice, parallel)
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


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
    if fmt == "generic":
        try:
            answer = _loads.decode(text)
        except ValueError:  # cut by max_tokens before the JSON closed
            return text, []
        if isinstance(answer.get("response"), str):
            return answer["response"], []
        got = answer.get("tool_calls") or [answer.get("tool_call")]
        calls = [_call(c, names, "arguments") for c in got]
        return (text, []) if None in calls else (None, calls)
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
