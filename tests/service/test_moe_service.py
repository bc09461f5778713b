"""A mixture-of-experts model through the service: a worker of its own serving a random-weight
Qwen3-MoE (4 experts, 2 a token; its first layer dense), with its own Redis and API. A
native job of several prompts, sampled n times too, and an OpenAI chat completion with the
official client give what the engine gives in this process (tests/test_engine.py holds the
engine's tokens equal to transformers' on the same model)."""
import openai
import pytest
import redis as redis_lib

from cli.redis_server import EmbeddedRedis
from conftest import WorkerProc, start_api
from results import reader
from results.client import Client
from worker.engine import Engine, SamplingParams
from worker.engine.models.tiny import build_tiny_model

NAME = "tiny-qwen3-moe"
PROMPTS = ["the quick brown fox", "def fibonacci(n):", "import os", "hello world, again and again"]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("moe-service") / "qwen3_moe"), arch="qwen3_moe")


@pytest.fixture(scope="module")
def moe_service(moe_model, tmp_path_factory):
    """(API url, redis url) of a service whose only worker serves the Qwen3-MoE."""
    server = EmbeddedRedis()
    logs = tmp_path_factory.mktemp("moe-logs")
    api, url = start_api(server.url, logs, "api-moe")
    w = WorkerProc(server.url, moe_model, logs, args=["--served-model-name", NAME])
    w.start()
    yield url, server.url
    w.stop()
    api.stop()
    server.stop()


@pytest.fixture(scope="module")
def moe_engine(moe_model):
    return Engine(moe_model, device="cpu")


def test_a_native_job_equals_the_engine(moe_service, moe_engine):
    url, redis_url = moe_service
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    sampled = {"max_new_tokens": 8, "temperature": 0.9, "n": 3, "ignore_eos": True}
    with Client(url) as c:
        job = c.submit(prompts=PROMPTS, sampling_params=[greedy] * 3 + [sampled], seed=11, model=NAME)
        conn = redis_lib.Redis.from_url(redis_url)
        try:
            list(reader.follow(conn, job["id"], timeout=120))
        finally:
            conn.close()
        info = c.status(job["id"])
        items = c.results(job["id"])
    assert info["status"] == "succeeded", info
    ref = moe_engine.generate(prompts=PROMPTS, sampling_params=[SamplingParams(**greedy)] * 3
                              + [SamplingParams(**sampled)], seed=11)
    got = [[s["token_ids"] for s in it["samples"]] for it in items]
    assert got == [[s.token_ids for s in it.samples] for it in ref]
    assert [len(g) for g in got] == [1, 1, 1, 3] and all(len(t) == 12 for g in got[:3] for t in g)


def test_an_openai_chat_completion_equals_the_engine(moe_service, moe_engine):
    url, _ = moe_service
    messages = [{"role": "user", "content": "say something"}]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    ref = moe_engine.generate(messages=[messages], sampling_params=SamplingParams(max_new_tokens=10, temperature=0))
    assert out.choices[0].message.content == ref[0].samples[0].text
    assert out.usage.completion_tokens == len(ref[0].samples[0].token_ids)
