"""The newer model families through the service: for each, a worker of its own serving a
random-weight model, with its own Redis and API: Qwen3-MoE (4 experts, 2 a token; its first
layer dense) and Gemma 3 (a sliding-window layer and a full one, soft-capped logits). A
native job of several prompts, sampled n times too, and an OpenAI chat completion with the
official client give what the engine gives in this process (tests/test_engine.py holds the
engine's tokens equal to transformers' on the same models)."""
import openai
import pytest
import redis as redis_lib

from conftest import own_service
from results import reader
from results.client import Client
from worker.engine import Engine, SamplingParams
from worker.engine.models.tiny import build_tiny_model

PROMPTS = ["the quick brown fox", "def fibonacci(n):", "import os", "hello world, again and again"]


@pytest.fixture(scope="module", params=["qwen3_moe", "gemma3"])
def family(request, tmp_path_factory):
    """(its served name, its folder) of one family's random-weight model."""
    arch = request.param
    return f"tiny-{arch}", build_tiny_model(str(tmp_path_factory.mktemp(arch) / arch), arch=arch)


@pytest.fixture(scope="module")
def service(family, tmp_path_factory):
    """(API url, redis url) of a service whose only worker serves the family's model."""
    name, path = family
    with own_service(path, tmp_path_factory.mktemp(f"{name}-logs"), name) as urls:
        yield urls


@pytest.fixture(scope="module")
def engine(family):
    return Engine(family[1], device="cpu")


def test_a_native_job_equals_the_engine(family, service, engine):
    url, redis_url = service
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    sampled = {"max_new_tokens": 8, "temperature": 0.9, "n": 3, "ignore_eos": True}
    with Client(url) as c:
        job = c.submit(prompts=PROMPTS, sampling_params=[greedy] * 3 + [sampled], seed=11, model=family[0])
        conn = redis_lib.Redis.from_url(redis_url)
        try:
            list(reader.follow(conn, job["id"], timeout=120))
        finally:
            conn.close()
        info = c.status(job["id"])
        items = c.results(job["id"])
    assert info["status"] == "succeeded", info
    ref = engine.generate(prompts=PROMPTS, sampling_params=[SamplingParams(**greedy)] * 3
                          + [SamplingParams(**sampled)], seed=11)
    got = [[s["token_ids"] for s in it["samples"]] for it in items]
    assert got == [[s.token_ids for s in it.samples] for it in ref]
    assert [len(g) for g in got] == [1, 1, 1, 3] and all(len(t) == 12 for g in got[:3] for t in g)


def test_an_openai_chat_completion_equals_the_engine(family, service, engine):
    url, _ = service
    messages = [{"role": "user", "content": "say something"}]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.chat.completions.create(model=family[0], messages=messages, max_tokens=10, temperature=0)
    ref = engine.generate(messages=[messages], sampling_params=SamplingParams(max_new_tokens=10, temperature=0))
    assert out.choices[0].message.content == ref[0].samples[0].text
    assert out.usage.completion_tokens == len(ref[0].samples[0].token_ids)
