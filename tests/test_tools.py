"""Tool calling in the engine: the template renders the tools and earlier calls; `required`
and a named function always give calls valid for their schemas (checked with jsonschema);
`auto` reads the model's own format (the tiny model's template is Hermes-style, and a regex
makes its random weights write a call, so the parse is checked on real engine output)."""
import json
import shutil

import jsonschema
import pytest

from worker.engine import Engine, SamplingParams
from worker.engine import tools
from worker.engine.tools import Tool

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
CHAT = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
SCHEMAS = {"get_weather": WEATHER, "now": {"type": "object", "properties": {}}}


@pytest.fixture(scope="module")
def engine(llama_path):
    return Engine(llama_path)


def assert_valid(calls):
    assert calls
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_required_and_a_named_function_give_calls_valid_for_their_schemas(engine):
    for parallel in (True, False):
        sp = SamplingParams(max_new_tokens=400, temperature=1.0, n=6, tools=TOOLS, tool_choice="required",
                            parallel_tool_calls=parallel)
        for s in engine.generate(messages=[CHAT], sampling_params=sp, seed=4)[0].samples:
            if s.finish_reason == "length":  # random weights may list calls until the limit
                assert parallel and s.tool_calls == [] and s.content == s.text
                continue
            assert s.finish_reason == "stop" and s.content is None
            assert_valid(s.tool_calls)
            assert parallel or len(s.tool_calls) == 1
    named = {"type": "function", "function": {"name": "get_weather"}}
    sp = SamplingParams(max_new_tokens=200, temperature=1.0, n=6, tools=TOOLS, tool_choice=named)
    for s in engine.generate(messages=[CHAT], sampling_params=sp, seed=5)[0].samples:
        assert [c["name"] for c in s.tool_calls] == ["get_weather"] and s.content is None
        assert_valid(s.tool_calls)


def test_auto_parses_the_models_format_and_text_stays_content(engine):
    assert engine.front.tool_format == "hermes"  # told from the template's text
    call = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", "days": [1-7]\}\}</tool_call>'
    out = engine.generate(messages=[CHAT] * 2, sampling_params=[
        SamplingParams(max_new_tokens=400, tools=TOOLS, regex=r"Sure\. " + call + call),
        SamplingParams(max_new_tokens=20, tools=TOOLS, regex="[a-z ]{5,20}")])
    got, text = out[0].samples[0], out[1].samples[0]
    assert got.content == "Sure." and [c["name"] for c in got.tool_calls] == ["get_weather"] * 2
    assert_valid(got.tool_calls)
    assert text.tool_calls == [] and text.content == text.text
    none = engine.generate(messages=[CHAT], sampling_params=SamplingParams(
        max_new_tokens=100, tools=TOOLS, tool_choice="none", regex=call))[0].samples[0]
    assert none.tool_calls == [] and none.content == none.text  # none: not parsed
    plain = engine.generate(messages=[CHAT], sampling_params=SamplingParams(max_new_tokens=3))[0].samples[0]
    assert plain.tool_calls is None and plain.content is None  # no tools: no such fields


def test_a_tokenizer_without_a_template_fails_auto_alone(engine, monkeypatch):
    monkeypatch.setattr(engine.front, "tool_format", None)
    out = engine.generate(messages=[CHAT] * 2, sampling_params=[
        SamplingParams(max_new_tokens=4, tools=TOOLS), SamplingParams(max_new_tokens=4, tools=TOOLS,
                                                                      tool_choice="required")])
    assert out[0].samples[0].finish_reason == "error" and "chat template" in out[0].samples[0].error
    assert out[1].samples[0].finish_reason in ("stop", "length")  # the grammar needs no format


# SmolLM2's template, in the tiny model's tokens: no tool format, and m['content'] read as is
# (a message without content made it fail: "'dict object' has no attribute 'content'").
PLAIN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + eos_token + '\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def plain_engine(llama_path, tmp_path_factory):
    """The tiny model with PLAIN_TEMPLATE: tools in the generic format."""
    path = tmp_path_factory.mktemp("plain") / "llama"
    shutil.copytree(llama_path, path)
    (path / "chat_template.jinja").write_text(PLAIN_TEMPLATE)
    return Engine(str(path))


def test_generic_format_renders_tools_and_earlier_turns_for_a_template_without_one(plain_engine):
    assert plain_engine.front.tool_format == "generic"
    chat = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
            {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "tool", "tool_call_id": "c2", "content": "9:00"}]
    ids, _ = plain_engine.front.chats.encode(chat, None, SamplingParams(tools=TOOLS))
    text = plain_engine.tokenizer.decode(ids)
    assert text.startswith("<|bos|><|system|>\nYou can call these tools: [") and '"description": "the forecast"' in text
    assert '"response": "..."} to answer the user' in text
    assert ('<|assistant|>\n{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
            '{"name": "now", "arguments": {}}]}<|eos|>') in text
    assert text.endswith("<|user|>\nThe result of get_weather: sunny\nThe result of now: 9:00<|eos|>\n<|assistant|>\n")
    # A system message of the caller's own gets the tools after its text; none: no tools.
    ids, _ = plain_engine.front.chats.encode([{"role": "system", "content": "Be brief."}] + CHAT, None,
                                             SamplingParams(tools=TOOLS, tool_choice="none"))
    assert plain_engine.tokenizer.decode(ids).startswith("<|bos|><|system|>\nBe brief.<|eos|>")
    ids, _ = plain_engine.front.chats.encode([{"role": "system", "content": "Be brief."}] + CHAT, None,
                                             SamplingParams(tools=TOOLS, tool_choice="required"))
    assert plain_engine.tokenizer.decode(ids).startswith("<|bos|><|system|>\nBe brief.\n\nYou can call these tools:")


def test_generic_auto_answers_in_text_or_calls_valid_for_their_schemas(plain_engine):
    """Under auto the output is decoded under the generic schema: every sample that ends is
    a response (content, no calls) or calls that validate; both come up among 24 samples of
    random weights at temperature 5 (at 1 they all answer), and with parallel calls off there
    is one call at most."""
    kinds = set()
    for parallel in (True, False):
        sp = SamplingParams(max_new_tokens=300, temperature=5.0, n=24, tools=TOOLS, parallel_tool_calls=parallel)
        for s in plain_engine.generate(messages=[CHAT], sampling_params=sp, seed=7)[0].samples:
            if s.finish_reason == "length":
                assert s.tool_calls == [] and s.content == s.text
                continue
            assert s.finish_reason == "stop", s
            if s.tool_calls:
                assert s.content is None and (parallel or len(s.tool_calls) == 1)
                assert_valid(s.tool_calls)
                kinds.add("calls")
            else:
                assert s.content == json.loads(s.text)["response"]
                kinds.add("response")
    assert kinds == {"calls", "response"}, kinds


@pytest.mark.parametrize("text,calls,content", [
    ('{"response": "It is sunny."}', [], "It is sunny."),
    ('{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}',
     [("get_weather", {"city": "Oslo", "days": 2})], None),
    ('{"tool_calls": [{"name": "now", "arguments": {}}, {"name": "now", "arguments": {}}]}', [("now", {}), ("now", {})], None),
    ('{"tool_call": {"name": "now", "argu', [], '{"tool_call": {"name": "now", "argu'),  # cut by max_tokens
    ('{"tool_call": {"name": "rm_rf", "arguments": {}}}', [], '{"tool_call": {"name": "rm_rf", "arguments": {}}}')])
def test_generic_parse(text, calls, content):
    got_content, got = tools.parse(text, "generic", [Tool.model_validate(t) for t in TOOLS], "auto")
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls and got_content == content


def test_the_template_renders_tools_earlier_calls_and_tool_messages(engine):
    chat = CHAT + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    ids, _ = engine.front.chats.encode(chat, None, SamplingParams(tools=TOOLS))
    text = engine.tokenizer.decode(ids)
    assert '"name": "get_weather"' in text and "the forecast" in text  # the tools, as the template writes them
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>' in text
    assert "<|tool|>\nsunny" in text
    out = engine.generate(messages=[chat], sampling_params=SamplingParams(max_new_tokens=4, tools=TOOLS))
    assert out[0].samples[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("text,calls,content", [
    ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', [("now", {})], None),
    ('I will look. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'
     '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>', [("get_weather", {"city": "Oslo", "days": 2}),
                                                                    ("now", {})], "I will look."),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', [], '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),
    ('<tool_call>{"name": "now", "arguments": {</tool_call>', [], '<tool_call>{"name": "now", "arguments": {</tool_call>'),
    ("just text", [], "just text")])
def test_hermes_parse(text, calls, content):
    got_content, got = tools.parse(text, "hermes", [Tool.model_validate(t) for t in TOOLS], "auto")
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls and got_content == content


@pytest.mark.parametrize("text,calls", [
    ('{"name": "get_weather", "parameters": {"city": "Rome; Italy", "days": 1}}', [("get_weather", {"city": "Rome; Italy", "days": 1})]),
    ('<|python_tag|>{"name": "now", "parameters": {}}; {"name": "now", "parameters": {}}', [("now", {}), ("now", {})]),
    ("The answer is 4.", []),
    ('{"name": "now", "parameters": {}} and more', [])])
def test_llama3_json_parse(text, calls):
    content, got = tools.parse(text, "llama3_json", [Tool.model_validate(t) for t in TOOLS], "auto")
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls
    assert content == (None if calls else text)


def test_formats_are_told_from_templates_and_bad_choices_are_refused():
    assert tools.format_of("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}") == "hermes"
    assert tools.format_of("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert tools.format_of("{{ messages }}") == "generic" and tools.format_of(None) is None
    for bad, msg in [({"tool_choice": "required"}, "needs tools"),
                     ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "no tool is named"),
                     ({"tools": TOOLS + TOOLS[:1]}, "same name"),
                     ({"tools": TOOLS, "tool_choice": "required", "regex": "a"}, "give at most one"),
                     ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                       "tool_choice": "required"}, "tools: a function's parameters: .*nope")]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**bad)
