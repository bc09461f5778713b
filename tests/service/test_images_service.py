"""Images through the service: a worker of its own on a tiny LLaVA (built offline), with its
own Redis and API (the session's text worker must not take these jobs). Native chat items
with image parts match Engine.generate(messages=...); a bad image fails its item alone; the
OpenAI chat endpoint takes image data URLs."""
import base64
import io

import pytest
import torch
from PIL import Image as PILImage

from results import reader
from worker.engine import Engine, SamplingParams
from worker.engine.models.tiny import build_tiny_llava
from worker.redis_server import EmbeddedRedis

from conftest import WorkerProc, start_api

SP = {"max_new_tokens": 6, "temperature": 0}


def data_url(w=30, h=28, seed=0):
    g = torch.Generator().manual_seed(seed)
    img = PILImage.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"


def chat(url, text="what is it"):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_tiny_llava(str(tmp_path_factory.mktemp("llava-service") / "llava"), max_context=256)


@pytest.fixture(scope="module")
def vision_service(llava, tmp_path_factory):
    """(API url, redis url) of a service whose only worker serves the LLaVA."""
    server = EmbeddedRedis()
    logs = tmp_path_factory.mktemp("vision-logs")
    api, url = start_api(server.url, logs, "api-vision")
    w = WorkerProc(server.url, llava, logs, args=["--served-model-name", "tiny-llava"])
    w.start()
    yield url, server.url
    w.stop()
    api.stop()
    server.stop()


@pytest.fixture(scope="module")
def llava_engine(llava):
    return Engine(llava, device="cpu")


def test_native_chat_with_an_image_and_a_bad_one(vision_service, llava_engine):
    from results.client import Client
    import redis as redis_lib
    url, redis_url = vision_service
    good = chat(data_url(seed=1))
    bad = chat("data:image/png;base64,bm90IGFuIGltYWdl")  # valid base64, not an image
    with Client(url) as c:
        job = c.submit(messages=[good, bad], sampling_params=SP, seed=7)
        conn = redis_lib.Redis.from_url(redis_url)
        list(reader.follow(conn, job["id"], timeout=60))
        conn.close()
        info = c.status(job["id"])
        items = c.results(job["id"])
    assert info["status"] == "succeeded" and info["progress"]["failed"] == 1, info
    ref = llava_engine.generate(messages=[good], sampling_params=SamplingParams(**SP), seed=7)[0]
    ok = items[0]["samples"][0]
    assert ok["finish_reason"] != "error" and ok["token_ids"] == ref.samples[0].token_ids
    assert ok["text"] == ref.samples[0].text
    failed = items[1]["samples"][0]
    assert failed["finish_reason"] == "error" and "image 0" in failed["error"], failed


def test_native_rejects_bad_parts_at_the_edge(vision_service):
    import httpx
    url, _ = vision_service
    for content, where in (
            ([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
             ["body", "messages", 0, 0, "content", 0, "image_url", "url"]),
            ([{"type": "audio", "audio": {}}], ["body", "messages", 0, 0, "content", 0])):
        r = httpx.post(url + "/v1/jobs", json={"messages": [[{"role": "user", "content": content}]]})
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == where, r.text


def test_openai_chat_with_an_image(vision_service, llava_engine):
    from openai import BadRequestError, OpenAI
    url, _ = vision_service
    messages = chat(data_url(w=40, h=33, seed=2), "describe")
    ref = llava_engine.generate(messages=[messages], sampling_params=SamplingParams(max_new_tokens=6, temperature=0))[0]
    oai = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    r = oai.chat.completions.create(model="tiny-llava", messages=messages, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == ref.samples[0].text
    assert r.usage.completion_tokens == len(ref.samples[0].token_ids)
    # Not a data URL: 400 at the edge, naming the field.
    with pytest.raises(BadRequestError) as e:
        oai.chat.completions.create(model="tiny-llava", max_tokens=2, messages=chat("https://example.com/a.png"))
    assert e.value.body["param"] == "messages[0].content[0].image_url.url"
    # Not an image: the item's error, as a 400.
    with pytest.raises(BadRequestError) as e:
        oai.chat.completions.create(model="tiny-llava", max_tokens=2,
                                    messages=chat("data:image/png;base64,bm90IGFuIGltYWdl"))
    assert "image 0" in e.value.body["message"]
