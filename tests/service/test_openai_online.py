"""The OpenAI online endpoints with the official `openai` client against the live service
(real API and worker processes, real Redis): models, chat completions and completions,
streamed and not, equal to the engine's own output; errors in OpenAI's format."""
import json
import time

import httpx
import openai
import pytest

from worker.engine import SamplingParams

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}]


@pytest.fixture
def oai(api_url, worker):
    with openai.OpenAI(base_url=api_url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def chat_ids(engine, chat):
    tok = engine.tokenizer
    return tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


def test_models_lists_what_the_worker_serves(oai, engine):
    assert [m.id for m in oai.models.list().data] == ["llama"]  # the model folder's name
    card = oai.models.retrieve("llama")
    assert card.owned_by == "fanout" and card.root == "llama"
    assert card.max_model_len == engine.max_context  # what vLLM's clients read the context from
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")


def test_chat_completion_is_the_engines_greedy_answer_streamed_or_not(oai, engine):
    ids = chat_ids(engine, CHAT)
    ref = engine.generate(input_ids=[ids], sampling_params=SamplingParams(
        max_new_tokens=8, temperature=0, logprobs=True, top_logprobs=2))[0].samples[0]

    r = oai.chat.completions.create(model="llama", messages=CHAT, max_tokens=8, temperature=0,
                                    logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == "llama" and len(r.choices) == 1
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 8, len(ids) + 8)
    assert [t.token for t in choice.logprobs.content] == [x["token"] for x in ref.logprobs]
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx([x["logprob"] for x in ref.logprobs])
    assert [[t.token for t in x.top_logprobs] for x in choice.logprobs.content] == \
        [[t["token"] for t in x["top_logprobs"]] for x in ref.logprobs]

    chunks = list(oai.chat.completions.create(model="llama", messages=CHAT, max_tokens=8, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)

    # The job underneath is a native job: high priority, its model named.
    job = httpx.get(f"{oai.base_url}jobs/{r.id.removeprefix('chatcmpl-')}").json()
    assert (job["status"], job["priority"], job["model"]) == ("succeeded", "high", "llama")


def test_completions_map_n_seed_and_logprobs_for_several_prompts(oai, engine):
    prompts = ["Hello", "def fibonacci(n):"]
    ref = engine.generate(prompts=prompts, seed=5, sampling_params=SamplingParams(
        max_new_tokens=6, n=2, temperature=0.8, top_p=0.95, logprobs=True, top_logprobs=3))
    texts = [s.text for it in ref for s in it.samples]

    r = oai.completions.create(model="llama", prompt=prompts, n=2, seed=5, max_tokens=6, temperature=0.8,
                               top_p=0.95, logprobs=3)
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == texts
    lp = r.choices[3].logprobs
    assert lp.tokens == [x["token"] for x in ref[1].samples[1].logprobs]
    assert all(len(top) <= 3 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    assert r.usage.completion_tokens == 4 * 6

    streamed = {}
    for chunk in oai.completions.create(model="llama", prompt=prompts, n=2, seed=5, max_tokens=6,
                                        temperature=0.8, top_p=0.95, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(4)] == texts

    default = oai.completions.create(model="llama", prompt=[[5, 6, 7]], temperature=0)  # token ids; OpenAI's 16
    assert default.usage.completion_tokens <= 16 and default.usage.prompt_tokens == 3


def test_unsupported_fields_bad_values_and_unknown_models_get_openai_errors(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="llama", messages=CHAT, max_tokens=2, logit_bias={"5": 10})
    assert (e.value.param, e.value.code) == ("logit_bias", "unsupported_parameter")
    assert "logit_bias" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="llama", prompt="x", suffix="y")
    assert e.value.param == "suffix"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x", "name": "bob"}])
    assert e.value.param == "messages[0].name"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="llama", messages=CHAT, temperature=-1)
    assert e.value.param == "temperature" and e.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="llama", messages=CHAT, n=9)  # conftest: FANOUT_MAX_N=8
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="llama", messages=[{"role": "wizard", "content": "x"}])
    assert e.value.param == "messages[0].role" and "'assistant'" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="llama", messages=[{"role": "user", "content": 5}])
    assert e.value.param == "messages[0].content" and "a string or a list of parts" in e.value.message
    bad = httpx.post(str(oai.base_url) + "chat/completions", content=b'{"model": x}',
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] is None
    assert bad.json()["error"]["code"] == "invalid_json" and "character 10" in bad.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:  # a union's member labels are not named
        oai.chat.completions.create(model="llama", messages=CHAT, stop=["ok", ""])
    assert e.value.param == "stop[1]" and "constrained" not in e.value.message, e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert (e.value.param, e.value.code) == ("model", "model_not_found")


def test_a_prompt_that_cannot_run_is_a_400_streamed_or_not(oai):
    too_long = list(range(10, 300)) * 4  # 1,160 tokens: over the tiny model's context of 1,024
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model="llama", prompt=too_long, max_tokens=2, stream=stream)
        assert "context" in e.value.message and e.value.param == "prompt"
    # A chat's: param messages (before: null).
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="llama", messages=[{"role": "user", "content": "word " * 5000}], max_tokens=2)
    assert e.value.param == "messages" and "context" in e.value.message, e.value.message


def jobs_in_redis(r) -> set[str]:
    """The ids of every job with a key in Redis (online jobs are not listed)."""
    return {k.decode().split(":")[2] for k in r.scan_iter("fanout:job:*", count=1000)}


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_cancels_its_job(api_url, worker, stream, redis):
    body = {"model": "llama", "messages": CHAT, "max_tokens": 900, "ignore_eos": True, "stream": stream}
    before = jobs_in_redis(redis)
    # Not streamed, it waits 0.5 s for an answer that takes 900 decode steps, then goes away.
    with httpx.Client(timeout=httpx.Timeout(10, read=10 if stream else 0.5)) as c:
        try:
            with c.stream("POST", api_url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                for i, _ in enumerate(r.iter_lines()):
                    if i == 5:
                        break  # streamed: goes away after a few chunks
        except httpx.ReadTimeout:
            assert not stream
        else:
            assert stream, "the whole answer came before the client went away"
    (job_id,) = jobs_in_redis(redis) - before  # the request's job (online jobs are not listed)
    assert httpx.get(f"{api_url}/v1/jobs/{job_id}").json()["priority"] == "high"
    deadline = time.monotonic() + 15
    while (job := httpx.get(f"{api_url}/v1/jobs/{job_id}").json())["status"] != "canceled":
        assert time.monotonic() < deadline, job
        time.sleep(0.2)  # canceled, not succeeded: it stopped before its 900 tokens


def test_a_lone_surrogate_in_a_message_is_a_400_naming_it(api_url, worker):
    """Not a 500 with the tokenizer's exception: OpenAI's error shape, the message named."""
    raw = json.dumps({"model": "llama", "messages": [{"role": "user", "content": "bad \ud800"}], "max_tokens": 2})
    r = httpx.post(api_url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content" and "lone surrogate" in err["message"], err


def test_tokenize_and_detokenize_give_the_engines_ids(api_url, worker, engine):
    """vLLM's /tokenize and /detokenize, with the tokenizer the worker published: a prompt's
    ids are a job's, a chat's are its template's, and the text comes back. (The first call
    loads the tokenizer in the API process: seconds on a busy machine, hence the timeout.)"""
    r = httpx.post(api_url + "/tokenize", json={"model": "llama", "prompt": "hello world"}, timeout=60)
    assert r.status_code == 200, r.text
    ids = engine.tokenizer("hello world", add_special_tokens=True)["input_ids"]
    assert r.json() == {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids, "token_strs": None}
    # vLLM's options: the model may be left out (the fleet serves one), the pieces asked for.
    r = httpx.post(api_url + "/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    assert r.json()["tokens"] == ids and r.json()["token_strs"] == engine.tokenizer.convert_ids_to_tokens(ids)
    assert httpx.post(api_url + "/detokenize", json={"tokens": ids}).json()["prompt"] == engine.tokenizer.decode(ids)
    info = httpx.get(api_url + "/tokenizer_info").json()
    tok = engine.tokenizer
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template and info["model"] == "llama"
    assert info["model_max_length"] == engine.max_context and info["vocab_size"] == len(tok)
    assert httpx.get(api_url + "/tokenizer_info", params={"model": "gpt-4o"}).status_code == 404
    chat = [{"role": "user", "content": "hi there"}]
    r = httpx.post(api_url + "/tokenize", json={"model": "llama", "messages": chat})
    assert r.json()["tokens"] == chat_ids(engine, chat)
    back = httpx.post(api_url + "/detokenize", json={"model": "llama", "tokens": ids}).json()["prompt"]
    assert back == engine.tokenizer.decode(ids)
    bad = httpx.post(api_url + "/detokenize", json={"model": "llama", "tokens": [5, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
    missing = httpx.post(api_url + "/tokenize", json={"model": "gpt-4o", "prompt": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    both = httpx.post(api_url + "/tokenize", json={"model": "llama", "prompt": "x", "messages": chat})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]


def test_fields_clients_send_by_default_are_accepted_and_change_nothing(oai, api_url):
    plain = oai.chat.completions.create(model="llama", messages=CHAT, max_tokens=6, temperature=0)
    extra = oai.chat.completions.create(model="llama", messages=CHAT, max_tokens=6, temperature=0, store=False,
                                        service_tier="auto", safety_identifier="u-1", prompt_cache_key="k",
                                        metadata={"run": "nightly"}, user="alice")
    assert extra.choices[0].message.content == plain.choices[0].message.content
    job = httpx.get(f"{api_url}/v1/jobs/{extra.id.removeprefix('chatcmpl-')}", timeout=10).json()
    assert job["metadata"] == {"run": "nightly", "user": "alice"}
    with pytest.raises(openai.BadRequestError) as e:  # it would change the output: refused, not ignored
        oai.chat.completions.create(model="llama", messages=CHAT, max_tokens=2, logit_bias={"5": 1})
    assert e.value.param == "logit_bias"


def test_online_requests_leave_nothing_behind(redis_url, worker, tmp_path_factory):
    """An online request's job is not listed and its keys go FANOUT_ONLINE_TTL after it ends
    (GET /v1/jobs/{id}: 404 then), answered or refused; a native job's stay."""
    import redis as redis_lib
    from conftest import start_api, wait_for
    grace = 3
    proc, url = start_api(redis_url, tmp_path_factory.mktemp("online-ttl"), "api-online-ttl",
                          env={"FANOUT_ONLINE_TTL": str(grace)})
    r = redis_lib.Redis.from_url(redis_url)
    try:
        before = jobs_in_redis(r)
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
            answered = [c.chat.completions.create(model="llama", messages=CHAT, max_tokens=2).id for _ in range(3)]
            with pytest.raises(openai.BadRequestError):  # refused by the worker: longer than the context
                c.completions.create(model="llama", prompt="word " * 1100, max_tokens=2)
        native = httpx.post(url + "/v1/jobs", json={"prompts": ["x"], "sampling_params": {"max_new_tokens": 2}}).json()["id"]
        ids = [a.removeprefix("chatcmpl-") for a in answered]
        assert all(httpx.get(f"{url}/v1/jobs/{j}").status_code == 200 for j in ids)  # within the grace
        listed = {j["id"] for j in httpx.get(url + "/v1/jobs", params={"limit": 100}).json()["data"]}
        assert not listed & set(ids) and native in listed
        wait_for(lambda: all(httpx.get(f"{url}/v1/jobs/{j}").status_code == 404 for j in ids), grace + 10,
                 "the online jobs to go")
        time.sleep(1)  # the refused request's job ended before the answered ones'
        assert jobs_in_redis(r) - before == {native}  # every key of every online job gone, the refused one's too
        assert not any(r.zscore(k, j) for j in ids for k in r.scan_iter("fanout:jobs*"))
        assert httpx.get(f"{url}/v1/jobs/{native}").status_code == 200  # FANOUT_RESULT_TTL
    finally:
        proc.stop()
        r.close()
