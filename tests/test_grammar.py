"""Constrained decoding on the real model (SmolLM2-135M-Instruct, the demo model): sampled at
temperature 1, every constrained output parses and validates, or matches its regex or
choice; free items in the same batch get the tokens they get alone; one compile per grammar.

The batch that most tests read runs once (the `mixed` fixture): 200 JSON samples over four
schemas, regex, choice and fallback items, and free items.
"""
import json
import re

import jsonschema
import pytest
import xgrammar
from pydantic import ValidationError

from worker.engine import Engine, SamplingParams
from worker.engine.grammar import GrammarError
from worker.engine.models import demo

SCHEMAS = {
    "a person and their address": ({
        "type": "object", "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "address": {"type": "object", "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 8},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
        "required": ["name", "address"]}, 96),
    "a T-shirt in stock": ({
        "type": "object", "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                       "minItems": 1, "maxItems": 3},
            "size": {"enum": ["S", "M", "L"]},
            "in_stock": {"type": "boolean"}}, "required": ["colors", "size", "in_stock"]}, 48),
    "today's weather": ({
        "type": "object", "properties": {
            "celsius": {"type": "number", "minimum": -40, "maximum": 50},
            "wind": {"type": "integer", "exclusiveMinimum": 0, "maximum": 200}},
        "required": ["celsius", "wind"]}, 48),
    "a to-do list": ({
        "type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                             "done": {"type": "boolean"}}, "required": ["id", "done"]}},
        64),
}
PROMPTS_PER_SCHEMA, N = 10, 5  # 4 x 10 x 5 = 200 samples
PHONE, DATE = r"\(\d{3}\) \d{3}-\d{4}", r"20\d{2}-(0[1-9]|1[0-2])-[0-2]\d"
CHOICES = ["yes", "no", "it depends"]
# Schemas and regexes xgrammar does not take (allOf: compiled but not enforced; \p{..}: not
# parsed); llguidance does.
ALL_OF = {"allOf": [{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                     "additionalProperties": False}, {"required": ["n"]}]}
NAME = r"\p{Lu}\p{Ll}{1,8}"


def chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   tokenize=False)


@pytest.fixture(scope="module")
def engine():
    return Engine(demo.fetch_demo_model(), kv_tokens=16384)


def hot(**kw):
    return SamplingParams(temperature=1.0, **kw)


@pytest.fixture(scope="module")
def mixed(engine):
    """One batch of everything; items[kind] lists (index, prompt, params, result)."""
    tok = engine.tokenizer
    items = []

    def add(kind, text, params):
        items.append((kind, chat(tok, text), params))

    for what, (schema, max_new) in SCHEMAS.items():
        for i in range(PROMPTS_PER_SCHEMA):
            add(("json", what), f"Give me {what} as JSON (example {i + 1}).",
                hot(json_schema=schema, n=N, max_new_tokens=max_new))
    for i in range(4):
        add("phone", f"What is the phone number of shop {i}?", hot(regex=PHONE, max_new_tokens=24))
        add("date", f"When is event {i}?", hot(regex=DATE, max_new_tokens=16))
        add("choice", f"Is {i} an even number?", hot(choice=CHOICES, max_new_tokens=8))
        add("name", f"Name a city, number {i}.", hot(regex=NAME, max_new_tokens=16))
        add("all_of", f"Pick a digit, number {i}, as JSON.", hot(json_schema=ALL_OF, max_new_tokens=24))
    add("greedy", "Is the sky green?", SamplingParams(temperature=0.0, choice=CHOICES, max_new_tokens=8))
    # The grammar ends the output even with ignore_eos.
    add("ignore_eos", "Is water wet?", hot(choice=CHOICES, ignore_eos=True, max_new_tokens=8))
    # Logprobs are the model's own: its favourite first token is not "zebra".
    add("logprobs", "Say hello.", SamplingParams(temperature=0.0, choice=["zebra"], logprobs=True,
                                                 top_logprobs=2, max_new_tokens=8))
    add("stop", "List two fruits.", hot(regex=r"[a-z]{2,8}, [a-z]{2,8}", stop=[","], max_new_tokens=24))
    # Items with seeds of their own: the same tokens wherever they run (see `alone`).
    weather, max_new = SCHEMAS["today's weather"]
    for i in range(3):
        add("free", f"Tell me a fact about the number {i}.", hot(seed=100 + i, max_new_tokens=8))
        add("seeded", f"Give me today's weather in city {i} as JSON.",
            hot(seed=200 + i, json_schema=weather, max_new_tokens=max_new))
    results = engine.generate(prompts=[p for _, p, _ in items], sampling_params=[sp for _, _, sp in items],
                              seed=2026)
    out: dict = {}
    for (kind, prompt, sp), res in zip(items, results):
        out.setdefault(kind, []).append((res.index, prompt, sp, res))
    return out


def samples(mixed, kind):
    return [(sp, s) for _, _, sp, r in mixed[kind] for s in r.samples]


def test_json_schemas_always_validate(mixed):
    checked = 0
    for what, (schema, _) in SCHEMAS.items():
        validator = jsonschema.Draft202012Validator(schema)
        texts = []
        for _, s in samples(mixed, ("json", what)):
            assert s.finish_reason == "stop" and s.error is None, (s.finish_reason, s.text)
            validator.validate(json.loads(s.text))
            texts.append(s.text)
            checked += 1
        assert len(set(texts)) > len(texts) // 2  # sampled: mostly different outputs
    assert checked == len(SCHEMAS) * PROMPTS_PER_SCHEMA * N == 200


def test_regex_and_choice_outputs_match(mixed):
    for kind, pattern in [("phone", PHONE), ("date", DATE)]:
        for _, s in samples(mixed, kind):
            assert s.finish_reason == "stop" and re.fullmatch(pattern, s.text), (kind, s.text)
    for _, s in samples(mixed, "name"):  # NAME, which Python's re cannot read
        assert s.finish_reason == "stop" and s.text.isalpha() and s.text[0].isupper(), s.text
        assert s.text[1:].islower() and 2 <= len(s.text) <= 9, s.text
    for kind in ("choice", "greedy", "ignore_eos"):
        for _, s in samples(mixed, kind):
            assert s.finish_reason == "stop" and s.text in CHOICES, (kind, s.text)
    [(_, s)] = samples(mixed, "ignore_eos")
    assert s.matched_stop == 2  # EOS, which the grammar allowed once complete


def test_llguidance_takes_what_xgrammar_does_not(engine, mixed):
    validator = jsonschema.Draft202012Validator(ALL_OF)
    for _, s in samples(mixed, "all_of"):
        assert s.finish_reason == "stop"
        validator.validate(json.loads(s.text))
    grammars = engine.front.grammars
    for params in (SamplingParams(json_schema=ALL_OF), SamplingParams(regex=NAME)):
        assert grammars.matcher(params.grammar)._ll
    # Why allOf goes to llguidance: xgrammar compiles it, then lets "{}" through.
    m = xgrammar.GrammarMatcher(grammars._compile_xgrammar(*SamplingParams(json_schema=ALL_OF).grammar))
    assert all(m.accept_token(t) for t in engine.tokenizer.encode("{}", add_special_tokens=False))
    assert m.accept_token(2) and m.is_terminated()
    # xgrammar takes a raw form feed in a string with a length bound (JSON forbids control
    # characters in strings); our grammars (XGRAMMAR_BOUNDED_CHAR) do not.
    bounded = SamplingParams(json_schema={"type": "object", "properties": {"s": {"type": "string", "maxLength": 9}},
                                          "required": ["s"], "additionalProperties": False})
    raw = engine.tokenizer.encode('{"s": "a\x0cb', add_special_tokens=False)
    m = xgrammar.GrammarMatcher(grammars._xgr.compile_json_schema(bounded.json_schema, any_whitespace=False))
    assert all(m.accept_token(t) for t in raw)
    ours = grammars.matcher(bounded.grammar)
    assert not ours._ll and not all(ours.accept(t) for t in raw)


def test_logprobs_are_the_models_own(mixed):
    [(_, s)] = samples(mixed, "logprobs")
    assert s.text == "zebra"
    first = s.logprobs[0]
    assert first["token_id"] == s.token_ids[0] and first["logprob"] < first["top_logprobs"][0]["logprob"]


def test_stop_strings_cut_constrained_output(mixed):
    [(_, s)] = samples(mixed, "stop")
    assert s.finish_reason == "stop" and s.matched_stop == "," and re.fullmatch(r"[a-z]{2,8}", s.text)


def test_free_items_and_seeded_samples_unchanged_by_the_batch(engine, mixed):
    """The free and seeded items alone give the same tokens as among 200 constrained ones."""
    picked = mixed["free"] + mixed["seeded"]
    alone = engine.generate(prompts=[p for _, p, _, _ in picked], sampling_params=[sp for _, _, sp, _ in picked])
    for (_, _, sp, before), now in zip(picked, alone):
        assert now.samples[0].token_ids == before.samples[0].token_ids
    for _, _, sp, r in mixed["seeded"]:
        jsonschema.validate(json.loads(r.samples[0].text), sp.json_schema)


def test_retraction_keeps_the_grammar_state(engine, mixed):
    """Retract every running request mid-output (as a KV shortage would); their outputs are
    those they got without."""
    picked = mixed["seeded"]
    tag, box = object(), []
    engine.add(tag, [(i, p, None) for i, (_, p, _, _) in enumerate(picked)], [sp for _, _, sp, _ in picked],
               sink=box.append)
    sched = engine.scheduler
    for _ in range(20):  # a few tokens each, far from done
        if any(len(r.output_ids) >= 5 for r in sched.running):
            break
        engine.step()
    retracted = list(sched.running)
    for r in reversed(retracted):
        sched._retract(r)
    assert retracted and all(r.grammar is not None for r in retracted)
    while len([e for e in box if e.finished]) < len(picked):
        engine.step()
    final = {e.index: e for e in box if e.finished}
    for i, (_, _, _, before) in enumerate(picked):
        assert final[i].token_ids == before.samples[0].token_ids
    engine.check()


def test_abort_constrained_requests(engine):
    tag, box = object(), []
    sp = hot(json_schema=SCHEMAS["a to-do list"][0], n=2, max_new_tokens=64)
    engine.add(tag, [(0, chat(engine.tokenizer, "A to-do list as JSON."), None)], sp, sink=box.append)
    for _ in range(4):
        engine.step()
    assert engine.abort(tag) == 2
    assert [e.finish_reason for e in box if e.finished] == ["abort", "abort"]
    assert not engine.has_work()
    engine.check()


def test_each_grammar_compiles_once(engine, mixed):
    grammars = engine.front.grammars
    distinct = {sp.grammar for kind in mixed for _, _, sp, _ in mixed[kind] if sp.grammar}
    assert distinct <= set(grammars.cache)
    before = grammars.compiles
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    tag = object()
    engine.add(tag, [(i, None, [1, 2, 3]) for i in range(10_000)], SamplingParams(json_schema=schema),
               sink=lambda ev: None)
    assert grammars.compiles == before + 1
    assert engine.abort(tag) == 10_000
    engine.check()


def test_bad_grammars_fail_at_validation_with_the_librarys_message():
    def error(**kw):
        with pytest.raises(ValidationError) as e:
            SamplingParams(**kw)
        return [(x["loc"], x["msg"]) for x in e.value.errors()]

    assert error(json_schema={"type": "strin"}) == [(("json_schema",), "Value error, Invalid type: strin")]
    assert error(json_schema={"type": "integer", "minimum": 5, "maximum": 2}) == [(
        ("json_schema",), "Value error, Unsatisfiable schema: minimum (5) is greater than maximum (2)")]
    assert error(json_schema='{"type": "object", "properties": {"a": {"$ref": "#/$defs/b"}}}') == [(
        ("json_schema",), "Value error, Pointer '/$defs/b' does not exist")]
    assert error(json_schema="[1]") == [(("json_schema",), "Value error, must be a JSON object")]
    assert error(json_schema="{")[0][1].startswith("Value error, not JSON: ")
    assert "unclosed character class" in error(regex="[a-")[0][1]
    assert error(choice=[""])[0][0] == ("choice", 0)
    assert error(regex="a", choice=["a"]) == [((), "Value error, regex, choice: give at most one")]
    assert error(json_object=True, min_new_tokens=1) == [
        ((), "Value error, min_new_tokens: cannot be combined with json_object")]
    assert "over 65536 characters" in error(json_schema={"enum": ["x" * 70_000]})[0][1]
    assert "over 65536 characters" in error(choice=["x" * 40_000] * 2)[0][1]
    # Given as JSON text or as an object: one grammar, one compile.
    assert SamplingParams(json_schema='{"type": "integer"}').grammar == \
        SamplingParams(json_schema={"type": "integer"}).grammar == ("json_schema", '{"type":"integer"}')
    assert SamplingParams(json_object=True).grammar == ("json_schema", '{"type":"object"}')


def test_a_grammar_no_library_compiles_fails_its_item_alone(engine):
    """Past validation (an engine caller who builds params unchecked), the item fails with
    both libraries' messages and the rest of the batch runs."""
    bad = SamplingParams.model_construct(json_schema={"type": "strin"}, max_new_tokens=4)
    with pytest.raises(GrammarError, match=r'Invalid type: strin \(llguidance\); '
                                           r'Unsupported type "strin" \(xgrammar\)'):
        engine.front.grammars.matcher(bad.grammar)
    out = engine.generate(prompts=["a", "b"], sampling_params=[bad, SamplingParams(max_new_tokens=2)])
    assert out[0].samples[0].finish_reason == "error"
    assert out[0].samples[0].error.startswith("json_schema: Invalid type: strin (llguidance)")
    assert len(out[1].samples[0].token_ids) == 2
