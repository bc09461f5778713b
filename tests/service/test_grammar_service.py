"""Constrained decoding through the service: per-item grammars in one job come back as
parseable, valid outputs (the tiny model's weights are random, its outputs valid all the same);
a bad schema is a 422 naming the item's field, with the grammar library's message; OpenAI's
response_format and our regex and choice extensions on /v1/chat/completions."""
import json
import re

import httpx
import jsonschema
import openai
import pytest

from worker.engine import SamplingParams

COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "bright": {"type": "boolean"}}, "required": ["color", "bright"]}
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
         "required": ["x", "tags"]}
SCORES = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 1, "maxItems": 4}


def test_a_job_with_per_item_grammars_returns_valid_outputs(client, engine):
    base = {"temperature": 1.0, "max_new_tokens": 64}
    params = [{**base, "json_schema": COLOR, "n": 2}, {**base, "json_schema": json.dumps(POINT)},
              {**base, "json_schema": SCORES}, {**base, "json_object": True, "max_new_tokens": 1000},
              {**base, "regex": r"[0-9]{3}-[a-z]{2}"}, {**base, "choice": ["up", "down"]},
              {**base, "max_new_tokens": 5}]
    prompts = ["color", "point", "scores", "object", "code", "way", "free"]
    items = client.run(prompts=prompts, sampling_params=params, seed=5, timeout=120)
    out = {it["index"]: [s for s in it["samples"]] for it in items}
    assert [len(out[i]) for i in range(len(prompts))] == [2, 1, 1, 1, 1, 1, 1]
    for i, schema in [(0, COLOR), (1, POINT), (2, SCORES), (3, {"type": "object"})]:
        for s in out[i]:
            assert s["finish_reason"] == "stop", s
            jsonschema.validate(json.loads(s["text"]), schema)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out[4][0]["text"]) and out[5][0]["text"] in ("up", "down")
    assert len(out[6][0]["token_ids"]) == 5
    # The worker ran what the engine runs here: the grammars survived the job's JSON payload.
    ref = engine.generate(prompts=prompts, sampling_params=[SamplingParams(**p) for p in params], seed=5)
    assert {(it["index"], s["sample"]): s["token_ids"] for it in items for s in it["samples"]} == \
        {(r.index, j): s.token_ids for r in ref for j, s in enumerate(r.samples)}


def test_a_bad_schema_is_a_422_with_the_librarys_message(api_url):
    body = {"prompts": ["a", "b"], "sampling_params": [{"json_schema": COLOR},
                                                       {"json_schema": {"type": "object", "required": 3}}]}
    r = httpx.post(api_url + "/v1/jobs", json=body, timeout=10)
    assert r.status_code == 422, r.text
    [err] = r.json()["detail"]
    assert err["loc"] == ["body", "sampling_params", 1, "json_schema"]
    assert "required" in err["msg"], err
    r = httpx.post(api_url + "/v1/jobs", json={"prompts": ["a"], "sampling_params": {"regex": "(a"}}, timeout=10)
    assert r.status_code == 422 and "unclosed group" in r.json()["detail"][0]["msg"], r.text


def test_openai_response_format_and_extensions(api_url, worker):
    chat = [{"role": "user", "content": "a color"}]
    with openai.OpenAI(base_url=api_url + "/v1", api_key="x", max_retries=0, timeout=60) as oai:
        r = oai.chat.completions.create(model="llama", messages=chat, max_tokens=64, n=2, seed=3, response_format={
            "type": "json_schema", "json_schema": {"name": "color", "schema": COLOR, "strict": True}})
        for c in r.choices:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.message.content), COLOR)
        r = oai.chat.completions.create(model="llama", messages=chat, max_tokens=8,
                                        extra_body={"choice": ["cyan", "magenta"]})
        assert r.choices[0].message.content in ("cyan", "magenta")
        r = oai.completions.create(model="llama", prompt="code:", max_tokens=8, extra_body={"regex": "[a-f]{4}"})
        assert re.fullmatch("[a-f]{4}", r.choices[0].text)
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="llama", messages=chat, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})
        assert e.value.param == "response_format" and "Invalid type: strin" in e.value.message
