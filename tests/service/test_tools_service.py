"""Tool calling against the live service with the clients people run, unchanged: the
official `openai` package (calls, streamed deltas, a two-turn loop, batch lines, a native
job), instructor's default mode and LangChain's `bind_tools` / function-calling structured
output. The service's tiny model has a Hermes-style template; under `required` or a named
function every call is valid for its schema (checked with jsonschema and pydantic); `auto`
is checked by making the random weights write a call with the `regex` extension."""
import json
import time

import instructor
import jsonschema
import openai
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from results import keys

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Oslo for 2 days?"}]
CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", "days": [1-7]\}\}</tool_call>'


@pytest.fixture
def oai(api_url, worker):
    with openai.OpenAI(base_url=api_url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def valid(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER)
    return args


def test_required_named_streamed_and_a_two_turn_loop(oai):
    r = oai.chat.completions.create(model="llama", messages=ASK, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_tokens=200, seed=1)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    args = valid(choice.message.tool_calls[0])
    named = oai.chat.completions.create(model="llama", messages=ASK, tools=TOOLS, n=3, max_tokens=200, seed=2,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for c in named.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        valid(c.message.tool_calls[0])

    # Streamed: the same call (same seed), as tool_calls deltas the client accumulates.
    chunks = list(oai.chat.completions.create(model="llama", messages=ASK, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=200, seed=1, stream=True))
    deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather")]
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert json.loads(deltas[0].function.arguments) == args
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

    # The agent loop's second turn: the assistant's calls and the tool's answer go back in.
    turn = ASK + [choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny, 21 C"}]
    again = oai.chat.completions.create(model="llama", messages=turn, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert again.choices[0].message.tool_calls is None and again.choices[0].finish_reason in ("stop", "length")
    assert again.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its answer were rendered


def test_auto_is_parsed_from_the_templates_format(oai):
    r = oai.chat.completions.create(model="llama", messages=ASK, tools=TOOLS, max_tokens=300,
                                    extra_body={"regex": r"On it\. " + CALL})
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "On it."
    valid(m.tool_calls[0])
    text = oai.chat.completions.create(model="llama", messages=ASK, tools=TOOLS, max_tokens=20,
                                       extra_body={"regex": "[a-z ]{3,12}"})
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content


def test_bad_tool_requests_and_a_template_without_tools(oai, redis):
    for kwargs, param in [({"tool_choice": "required"}, "tool_choice"),
                          ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
                          ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name")]:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="llama", messages=ASK, max_tokens=2, **kwargs)
        assert param is None or e.value.param == param, e.value.body
    bad_turn = ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                            "function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="llama", messages=bad_turn, max_tokens=2)
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="llama", messages=ASK + [{"role": "tool", "content": "x"}], max_tokens=2)
    assert "tool_call_id" in e.value.message
    # A model whose workers announce no tool format (a tokenizer without a chat template):
    # auto is a 400 naming it. (SmolLM2's template, with no tool format of its own, gets the
    # generic one: tests/service/test_agents.py.)
    redis.hset(keys.models(), "notools", json.dumps({"created": 0, "expires": time.time() + 60, "tools": None}))
    try:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="notools", messages=ASK, tools=TOOLS, max_tokens=2)
        assert e.value.param == "tool_choice" and "'notools'" in e.value.message
    finally:
        redis.hdel(keys.models(), "notools")


def test_tools_in_batch_lines_and_native_jobs(oai, client):
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "llama", "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                       "max_tokens": 200, "parallel_tool_calls": False, "seed": i}} for i in range(3)]
    f = oai.files.create(file=("tools.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    b = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (b := oai.batches.retrieve(b.id)).status != "completed":
        assert time.monotonic() < deadline and b.status in ("validating", "in_progress", "finalizing"), b
        time.sleep(0.2)
    out = [json.loads(x) for x in oai.files.content(b.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == ["q0", "q1", "q2"]
    for x in out:
        (c,) = x["response"]["body"]["choices"]
        assert c["finish_reason"] == "tool_calls"
        jsonschema.validate(json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]), WEATHER)
    job = client.submit(messages=[ASK], sampling_params={"max_new_tokens": 200, "tools": TOOLS,
                                                         "tool_choice": "required", "parallel_tool_calls": False})
    list(client.events(job["id"], timeout=120))
    (s,) = client.results(job["id"])[0]["samples"]
    assert s["content"] is None and [c["name"] for c in s["tool_calls"]] == ["get_weather"]
    jsonschema.validate(json.loads(s["tool_calls"][0]["arguments"]), WEATHER)


class Forecast(BaseModel):
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


def test_instructor_default_mode(api_url, worker):
    client = instructor.from_openai(openai.OpenAI(base_url=api_url + "/v1", api_key="x", max_retries=0))
    got = client.chat.completions.create(model="llama", response_model=Forecast, messages=ASK, max_tokens=200,
                                         max_retries=0)
    assert isinstance(got, Forecast) and 1 <= got.days <= 7


def test_langchain_bind_tools_and_function_calling_structured_output(api_url, worker):
    @tool(args_schema=Forecast)  # bounded strings: random weights write a string to the limit
    def get_weather(city: str, days: int) -> str:
        """The forecast of a city for some days."""
        return "sunny"

    # A seed, and one call: random weights may otherwise list calls until max_tokens.
    llm = ChatOpenAI(base_url=api_url + "/v1", api_key="x", model="llama", max_tokens=200, max_retries=0, seed=3)
    msg = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False).invoke("Weather in Oslo?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    assert set(msg.tool_calls[0]["args"]) == {"city", "days"}
    auto = ChatOpenAI(base_url=api_url + "/v1", api_key="x", model="llama", max_tokens=300, max_retries=0,
                      extra_body={"regex": CALL}).bind_tools([get_weather]).invoke("Weather in Oslo?")
    assert [c["name"] for c in auto.tool_calls] == ["get_weather"]
    got = llm.with_structured_output(Forecast, method="function_calling").invoke("Weather in Oslo?")
    assert isinstance(got, Forecast)
