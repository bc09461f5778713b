"""Prompt logprobs end to end, as scoring clients use them: native `prompt_logprobs` per
item in a job, and `/v1/completions` with `echo` + `logprobs` (+ `max_tokens: 0`) through
the official `openai` client, each within 1e-4 of transformers' log_softmax of the
teacher-forced logits on the same weights."""
import json

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

TOL = 1e-4


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference(hf, ids: list[int], k: int = 0) -> tuple[list[float], list[list[int]]]:
    """transformers' logprob of each of ids[1:] given the ones before, and the top-k ids."""
    with torch.no_grad():
        lsm = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]
    chosen = lsm.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return chosen.tolist(), lsm.topk(k, dim=-1).indices.tolist() if k else []


@pytest.fixture
def oai(api_url, worker):
    with openai.OpenAI(base_url=api_url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def test_a_scoring_job_returns_each_prompts_logprobs(client, engine, hf):
    prompts = ["The quick brown fox jumps over the lazy dog", "Hello", "1 2 3 4 5 6 7 8 9 10 11 12"]
    job = client.submit(prompts=prompts, sampling_params=[
        {"max_new_tokens": 0, "prompt_logprobs": 2}, {"max_new_tokens": 3, "prompt_logprobs": 0, "n": 2},
        {"max_new_tokens": 2}], seed=1)
    list(client.events(job["id"], timeout=120))
    items = client.results(job["id"])
    tok = engine.tokenizer
    for item, prompt, k in zip(items, prompts, (2, 0, None)):
        ids = tok(prompt)["input_ids"]
        for s in item["samples"]:
            if k is None:
                assert s["prompt_logprobs"] is None
                continue
            got = s["prompt_logprobs"]
            assert [r["token_id"] for r in got] == ids and got[0]["logprob"] is None
            want, top = reference(hf, ids, k)
            assert max(abs(r["logprob"] - w) for r, w in zip(got[1:], want)) < TOL
            assert [[t["token_id"] for t in r["top_logprobs"]] for r in got[1:]] == (top or [[]] * len(want))
    assert items[0]["samples"][0]["token_ids"] == [] and items[0]["samples"][0]["finish_reason"] == "length"
    assert items[1]["samples"][0]["prompt_logprobs"] == items[1]["samples"][1]["prompt_logprobs"]


def test_echo_with_logprobs_scores_the_prompt_as_openais_legacy_api(oai, engine, hf):
    """What lm-eval's loglikelihood requests send: token ids, echo, logprobs 1, max_tokens 1
    (or 0); the prompt's token_logprobs come first (the first null), then the output's."""
    tok = engine.tokenizer
    ids = tok("Paris is the capital of France")["input_ids"]
    want, top = reference(hf, ids, 1)
    for max_tokens in (0, 1):
        r = oai.completions.create(model="llama", prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens,
                                   temperature=0)
        lp = r.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:len(ids)], want)) < TOL
        assert lp.tokens[:len(ids)] == [tok.decode([t]) for t in ids]
        for d, t in zip(lp.top_logprobs[1:len(ids)], top):  # greedy tells: the top token, by its text
            assert list(d) == [tok.decode(t)]
        assert r.choices[0].text.startswith(tok.decode(ids))
        assert lp.text_offset[0] == 0 and r.usage.prompt_tokens == len(ids)
    # A text prompt echoes as given; without logprobs only the text is echoed.
    r = oai.completions.create(model="llama", prompt="Paris is", echo=True, max_tokens=2, temperature=0)
    assert r.choices[0].text.startswith("Paris is") and r.choices[0].logprobs is None
    # Several prompts in one request: each choice its own.
    r = oai.completions.create(model="llama", prompt=["a b c", "x y"], echo=True, logprobs=0, max_tokens=0)
    assert [c.text for c in r.choices] == ["a b c", "x y"]
    assert [len(c.logprobs.tokens) for c in r.choices] == [len(tok(p)["input_ids"]) for p in ("a b c", "x y")]


def test_prompt_logprobs_extension_and_what_echo_cannot_do(oai, api_url, engine, hf):
    ids = engine.tokenizer("a scored prompt")["input_ids"]
    body = httpx.post(f"{api_url}/v1/completions", json={"model": "llama", "prompt": ids, "max_tokens": 1,
                                                          "prompt_logprobs": 0}, timeout=60).json()
    got = body["choices"][0]["prompt_logprobs"]
    want, _ = reference(hf, ids)
    assert max(abs(r["logprob"] - w) for r, w in zip(got[1:], want)) < TOL
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="llama", prompt="x", echo=True, stream=True)
    assert e.value.body["param"] == "echo"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="llama", prompt="x", extra_body={"prompt_logprobs": 21})
    assert e.value.body["param"] == "prompt_logprobs"
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": "llama", "prompt": "x", "echo": True}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
    assert "echo" in e.value.message


def test_batch_lines_score_with_the_prompt_logprobs_extension(oai, engine, hf):
    import time

    ids = engine.tokenizer("scored in a batch")["input_ids"]
    line = {"custom_id": "s", "method": "POST", "url": "/v1/completions",
            "body": {"model": "llama", "prompt": ids, "max_tokens": 0, "prompt_logprobs": 1}}
    f = oai.files.create(file=("score.jsonl", json.dumps(line).encode()), purpose="batch")
    b = oai.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (b := oai.batches.retrieve(b.id)).status != "completed":
        assert time.monotonic() < deadline and b.status in ("validating", "in_progress", "finalizing"), b
        time.sleep(0.2)
    (out,) = [json.loads(x) for x in oai.files.content(b.output_file_id).text.splitlines()]
    got = out["response"]["body"]["choices"][0]["prompt_logprobs"]
    want, top = reference(hf, ids, 1)
    assert [r["token_id"] for r in got] == ids
    assert max(abs(r["logprob"] - w) for r, w in zip(got[1:], want)) < TOL
    assert [[t["token_id"] for t in r["top_logprobs"]] for r in got[1:]] == top
