"""Anthropic's Messages API with the official `anthropic` client, unchanged (its base URL
only), against the live service: a message equal to the engine's greedy output on the same
chat, the same streamed (its events rebuild the same message), stop sequences, a tool call
and its result in the next turn, and errors in Anthropic's shape."""
import json
import time

import anthropic
import httpx
import pytest

from worker.engine import SamplingParams

ASK = [{"role": "user", "content": "Tell me about the sea."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
# The SDK (2.x) has no sampling parameters of its own: they go in the body as the API takes them.
GREEDY = {"temperature": 0}
TOOLS = [{"name": "get_weather", "description": "the weather in a city", "input_schema": WEATHER}]


@pytest.fixture
def claude(api_url, worker):
    with anthropic.Anthropic(base_url=api_url, api_key="x", max_retries=0, timeout=60) as c:
        yield c


def greedy(engine, chat, n):
    return engine.generate(messages=[chat], sampling_params=SamplingParams(max_new_tokens=n, temperature=0))[0].samples[0]


def test_a_message_is_the_engines_answer_streamed_or_not(claude, engine):
    want = greedy(engine, [{"role": "system", "content": "Be brief."}] + ASK, 12)
    msg = claude.messages.create(model="llama", max_tokens=12, extra_body=GREEDY, system="Be brief.", messages=ASK)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == want.text
    assert msg.stop_reason == ("max_tokens" if want.finish_reason == "length" else "end_turn")
    assert msg.usage.output_tokens == len(want.token_ids) and msg.usage.input_tokens > 0
    with claude.messages.stream(model="llama", max_tokens=12, extra_body=GREEDY, system="Be brief.", messages=ASK) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(pieces) == want.text and len(pieces) >= 1
    assert final.content[0].text == want.text and final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens and final.usage.input_tokens == msg.usage.input_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(claude, engine):
    text = greedy(engine, ASK, 16).text
    stop = text[4:7]
    assert stop.strip() and text.index(stop) == 4, text  # a stop found first at character 4
    msg = claude.messages.create(model="llama", max_tokens=16, extra_body=GREEDY, messages=ASK, stop_sequences=[stop])
    assert msg.content[0].text == text[:4]
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)


def test_a_tool_call_and_its_result_in_the_next_turn(claude):
    msg = claude.messages.create(model="llama", max_tokens=100, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS, tool_choice={"type": "any"})
    assert msg.stop_reason == "tool_use"
    [call] = [b for b in msg.content if b.type == "tool_use"]
    assert call.name == "get_weather" and set(call.input) == {"city"} and call.id.startswith("toolu_")
    turn = claude.messages.create(model="llama", max_tokens=5, extra_body=GREEDY, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"},
                                     {"type": "text", "text": "Thanks."}]}], tool_choice={"type": "none"})
    assert turn.stop_reason in ("end_turn", "max_tokens") and turn.content[0].type == "text"
    with claude.messages.stream(model="llama", max_tokens=100, extra_body=GREEDY, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Oslo?"}]) as s:
        final = s.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert streamed.name == "get_weather" and set(streamed.input) == {"city"} and final.stop_reason == "tool_use"


def test_errors_are_anthropics(claude, api_url):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-nope", max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-nope" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="llama", max_tokens=5, messages=ASK, extra_body={"temperature": 1.5})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in e.value.body["error"]["message"]
    r = httpx.post(api_url + "/v1/messages", json={"model": "llama", "messages": ASK})  # no max_tokens
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"], r.text
    with pytest.raises(anthropic.BadRequestError) as e:  # a tool_use block in a user turn
        claude.messages.create(model="llama", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}])
    assert "messages.0.content" in e.value.body["error"]["message"]
    r = httpx.post(api_url + "/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    # A prompt the engine refuses (over the context) is a 400 naming why.
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="llama", max_tokens=5, messages=[{"role": "user", "content": "word " * 5000}])
    assert "context" in json.dumps(e.value.body)


def test_a_message_batch_of_50_ends_and_its_results_read_by_custom_id(claude, engine):
    questions = [f"Question number {i}?" for i in range(50)]
    batch = claude.messages.batches.create(requests=[
        {"custom_id": f"q-{i}", "params": {"model": "llama", "max_tokens": 6, "temperature": 0,
                                            "messages": [{"role": "user", "content": q}]}}
        for i, q in enumerate(questions)] + [
        {"custom_id": "too-long", "params": {"model": "llama", "max_tokens": 6,
                                              "messages": [{"role": "user", "content": "word " * 5000}]}}])
    assert batch.type == "message_batch" and batch.id.startswith("msgbatch_")
    assert batch.processing_status == "in_progress" and batch.results_url is None
    deadline = time.monotonic() + 120
    while (batch := claude.messages.batches.retrieve(batch.id)).processing_status != "ended":
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    counts = batch.request_counts
    assert (counts.succeeded, counts.errored, counts.processing, counts.canceled) == (50, 1, 0, 0)
    assert batch.ended_at is not None and batch.results_url.endswith(f"/v1/messages/batches/{batch.id}/results")
    got = {r.custom_id: r.result for r in claude.messages.batches.results(batch.id)}
    assert list(got) == [f"q-{i}" for i in range(50)] + ["too-long"]  # the requests' order
    want = engine.generate(messages=[[{"role": "user", "content": q}] for q in questions],
                           sampling_params=SamplingParams(max_new_tokens=6, temperature=0))
    for i, it in enumerate(want):
        r = got[f"q-{i}"]
        assert r.type == "succeeded" and r.message.content[0].text == it.samples[0].text
    assert got["too-long"].type == "errored" and "context" in got["too-long"].error.error.message
    listed = claude.messages.batches.list(limit=5)
    assert batch.id in [b.id for b in listed.data]
    assert claude.messages.batches.delete(batch.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.batches.retrieve(batch.id)


def test_a_canceled_message_batch_keeps_what_finished(claude):
    batch = claude.messages.batches.create(requests=[
        {"custom_id": f"r{i}", "params": {"model": "llama", "max_tokens": 900, "temperature": 1,
                                           "messages": [{"role": "user", "content": f"Tell me a long story {i}."}]}}
        for i in range(30)])
    canceling = claude.messages.batches.cancel(batch.id)
    assert canceling.processing_status in ("canceling", "ended") and canceling.cancel_initiated_at is not None
    deadline = time.monotonic() + 60
    while (batch := claude.messages.batches.retrieve(batch.id)).processing_status != "ended":
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    c = batch.request_counts
    assert c.canceled > 0 and c.succeeded + c.errored + c.canceled == 30 and c.processing == 0, c
    kinds = [r.result.type for r in claude.messages.batches.results(batch.id)]
    assert len(kinds) == 30 and kinds.count("canceled") == c.canceled and kinds.count("succeeded") == c.succeeded
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.batches.retrieve("msgbatch_nope")
