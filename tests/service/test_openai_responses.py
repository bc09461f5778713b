"""OpenAI's Responses API with the official `openai` client, unchanged: responses.create
(the engine's greedy answer on the same chat), .stream (its events rebuild the same text),
.parse (a pydantic model, decoded under its schema), a function call continued through
previous_response_id, stored responses, errors, and /v1/responses as a batch endpoint."""
import json

import openai
import pytest
from openai.types.responses import Response
from pydantic import BaseModel, Field

from test_openai_batch import jsonl, wait
from worker.engine import SamplingParams


class City(BaseModel):
    name: str = Field(max_length=12)
    rivers: int = Field(ge=0, le=9)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city", "parameters": WEATHER}]


@pytest.fixture
def oai(api_url, worker):
    with openai.OpenAI(base_url=api_url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def greedy(engine, chat, n):
    return engine.generate(messages=[chat], sampling_params=SamplingParams(max_new_tokens=n, temperature=0))[0].samples[0]


def test_create_and_stream_give_the_engines_answer_and_it_is_stored(oai, engine):
    want = greedy(engine, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}], 10)
    r = oai.responses.create(model="llama", input="Tell me about the sea.", instructions="Be brief.",
                             max_output_tokens=10, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == want.text
    assert r.status == ("incomplete" if want.finish_reason == "length" else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == len(want.token_ids) and r.usage.input_tokens > 0
    assert oai.responses.retrieve(r.id).output_text == want.text
    with oai.responses.stream(model="llama", input="Tell me about the sea.", instructions="Be brief.",
                              max_output_tokens=10, temperature=0) as s:
        seen = list(s)
    deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
    # the last event is response.incomplete when max_output_tokens ended it (the SDK's
    # get_final_response() takes only response.completed, as with OpenAI)
    assert seen[-1].type == "response." + r.status and seen[-1].response.output_text == want.text
    assert "".join(deltas) == want.text and [e.sequence_number for e in seen] == list(range(len(seen)))
    not_kept = oai.responses.create(model="llama", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(not_kept.id)


def test_parse_decodes_under_the_models_schema(oai):
    got = oai.responses.parse(model="llama", input="A city and its rivers, as JSON.", text_format=City,
                              max_output_tokens=200, temperature=1.0)
    assert isinstance(got.output_parsed, City)


def test_a_function_call_continued_through_previous_response_id(oai):
    r = oai.responses.create(model="llama", input="Weather in Oslo?", tools=TOOLS, tool_choice="required",
                             parallel_tool_calls=False, max_output_tokens=100, temperature=0)
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and '"city"' in call.arguments
    final = oai.responses.create(model="llama", previous_response_id=r.id, tools=TOOLS, tool_choice="none",
                                 input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
                                 max_output_tokens=5, temperature=0)
    assert final.previous_response_id == r.id and [o.type for o in final.output] == ["message"]
    assert final.usage.input_tokens > r.usage.input_tokens  # the earlier turns came along
    with oai.responses.stream(model="llama", input="Weather in Oslo?", tools=TOOLS, tool_choice="required",
                              max_output_tokens=100, temperature=0) as s:
        streamed = s.get_final_response()
    assert [o.type for o in streamed.output] == ["function_call"] and streamed.output[0].arguments == call.arguments


def test_errors_name_the_parameter(oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model="gpt-5", input="hi")
    assert e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="llama", input="hi", max_output_tokens=10**6)
    assert e.value.param == "max_output_tokens"
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="llama", input="hi", previous_response_id="resp_nope")
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="llama", input=[{"role": "user", "content": "word " * 5000}], max_output_tokens=2)
    assert e.value.param == "input" and "context" in e.value.message


def test_a_responses_batch_gives_the_engines_answers(oai, engine):
    def line(custom_id, **body):
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses",
                "body": {"model": "llama", "max_output_tokens": 6, "temperature": 0, **body}}

    texts = ["hi", "why is the sky blue?"]
    lines = [line(f"text-{i}", input=t, instructions="Be brief.") for i, t in enumerate(texts)]
    lines.append(line("call", input="Weather in Oslo?", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                      max_output_tokens=100))
    lines.append(line("json", input="A city.", text={"format": {"type": "json_schema", "name": "city",
                                                                "schema": WEATHER}}, max_output_tokens=100))
    f = oai.files.create(file=("r.jsonl", jsonl(lines)), purpose="batch")
    b = oai.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h")
    b = wait(oai, b.id, ("completed", "failed", "expired", "cancelled"))
    assert b.status == "completed", b
    assert b.request_counts.completed == 4 and b.error_file_id is None
    out = {x["custom_id"]: x["response"] for x in map(json.loads, oai.files.content(b.output_file_id).text.splitlines())}
    for i, t in enumerate(texts):
        want = greedy(engine, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": t}], 6)
        r = Response.construct(**out[f"text-{i}"]["body"])  # as the SDK reads a response: unvalidated
        assert out[f"text-{i}"]["status_code"] == 200 and r.object == "response" and r.id.startswith("resp_")
        assert r.output_text == want.text and r.usage.output_tokens == len(want.token_ids)
    [call] = out["call"]["body"]["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert set(json.loads(call["arguments"])) == {"city"}
    [msg] = out["json"]["body"]["output"]
    assert set(json.loads(msg["content"][0]["text"])) == {"city"}


def test_a_batch_line_cannot_continue_a_stored_response(oai):
    bad = {"custom_id": "a", "method": "POST", "url": "/v1/responses",
           "body": {"model": "llama", "input": "hi", "previous_response_id": "resp_x"}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.files.create(file=("r.jsonl", (json.dumps(bad) + "\n").encode()), purpose="batch")
    assert "previous_response_id" in e.value.message
