"""Images through the service: a worker of its own on a tiny LLaVA (built offline), with its
own Redis and API (the session's text worker must not take these jobs), allowed to download
images from the image server's 127.0.0.1:port (a real HTTP server: tests/conftest.py, ImageRoutes) and no file:// folder.
Native chat items with image parts match Engine.generate(messages=...); a bad image fails its
item alone; the OpenAI chat endpoint (streamed too) and OpenAI batch lines take image data
URLs; the session's text model refuses image parts by name; downloaded images equal data
URLs, the API refuses a scheme the workers do not take, and a slow download holds up only
its own job."""
import base64
import io
import json
import socket
import time

import pytest
import redis as redis_lib
import torch
from PIL import Image as PILImage

from results import keys, reader
from results.client import Client
from worker.engine import Engine, SamplingParams
from worker.engine.models.tiny import build_tiny_llava

from conftest import own_service, worker_pid

SP = {"max_new_tokens": 6, "temperature": 0}
IMAGE_MEMORY = 200_000_000  # the vision worker's --image-memory


def image(w=30, h=28, seed=0, fmt="PNG") -> bytes:
    g = torch.Generator().manual_seed(seed)
    img = PILImage.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def data_url(w=30, h=28, seed=0, fmt="PNG"):
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(image(w, h, seed, fmt)).decode()}"



def chat(url, text="what is it"):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def follow(redis_url, job_id):
    """Wait for the job's stream to end."""
    conn = redis_lib.Redis.from_url(redis_url)
    try:
        list(reader.follow(conn, job_id, timeout=60))
    finally:
        conn.close()


def slow_url(image_server, name, seed):
    """A URL whose image (a new one, not served yet) comes 6 s after it is asked for."""
    image_server.files[name] = image(seed=seed)
    image_server.served_at.pop(name, None)
    return f"{image_server.url}/sleep/6/{name}"


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_tiny_llava(str(tmp_path_factory.mktemp("llava-service") / "llava"), max_context=256)


@pytest.fixture(scope="module")
def vision_service(llava, tmp_path_factory, image_server):
    """(API url, redis url) of a service whose only worker serves the LLaVA."""
    # --delta-interval 0: every token its own stream entry, so the streaming tests see many.
    with own_service(llava, tmp_path_factory.mktemp("vision-logs"), "tiny-llava",
                     ["--delta-interval", "0", "--image-http-hosts", image_server.url.removeprefix("http://"),
                      "--image-memory", str(IMAGE_MEMORY)]) as urls:
        yield urls


@pytest.fixture(scope="module")
def llava_engine(llava):
    return Engine(llava, device="cpu")


def test_native_chat_with_an_image_and_a_bad_one(vision_service, llava_engine):
    url, redis_url = vision_service
    good = chat(data_url(seed=1))
    bad = chat("data:image/png;base64,bm90IGFuIGltYWdl")  # valid base64, not an image
    with Client(url) as c:
        job = c.submit(messages=[good, bad], sampling_params=SP, seed=7)
        follow(redis_url, job["id"])
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
            ([{"type": "image_url", "image_url": {"url": "ftp://example.com/a.png"}}],
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
    # A file URL, which this model's workers do not read (off by default): 400 naming the field.
    with pytest.raises(BadRequestError) as e:
        oai.chat.completions.create(model="tiny-llava", max_tokens=2, messages=chat("file:///tmp/a.png"))
    assert e.value.body["param"] == "messages[0].content[0].image_url.url"
    assert "file URLs are not taken by the workers of the model 'tiny-llava' (they take data, http, https)" \
        in e.value.body["message"]
    # Not an image: the item's error, as a 400.
    with pytest.raises(BadRequestError) as e:
        oai.chat.completions.create(model="tiny-llava", max_tokens=2,
                                    messages=chat("data:image/png;base64,bm90IGFuIGltYWdl"))
    assert "image 0" in e.value.body["message"]


@pytest.fixture
def oai(vision_service):
    from openai import OpenAI
    with OpenAI(base_url=vision_service[0] + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def batch_line(custom_id, messages, model="tiny-llava", **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": messages, **body}}


def run_batch(oai, lines, timeout=60):
    """Upload `lines`, create their chat batch, wait for it to end; the batch object."""
    f = oai.files.create(file=("images.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                         purpose="batch")
    b = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + timeout
    while b.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch still {b.status} after {timeout}s"
        time.sleep(0.2)
        b = oai.batches.retrieve(b.id)
    return b


def test_openai_batch_lines_with_images(vision_service, llava_engine, oai):
    chats = {"png": chat(data_url(seed=3), "what is it"),
             "jpeg": chat(data_url(w=44, h=31, seed=4, fmt="JPEG"), "and this"),
             "webp": chat(data_url(w=29, h=50, seed=5, fmt="WEBP"), "describe")}
    bad = chat("data:image/jpeg;base64,bm90IGFuIGltYWdl")  # valid base64, not an image
    lines = [batch_line("png", chats["png"], max_tokens=6, temperature=0),
             batch_line("bad", bad, max_tokens=6, temperature=0),
             batch_line("jpeg", chats["jpeg"], max_tokens=6, temperature=0),
             batch_line("webp", chats["webp"], max_tokens=6, temperature=0)]
    b = run_batch(oai, lines)
    assert b.status == "completed" and b.request_counts.model_dump() == {"total": 4, "completed": 3, "failed": 1}
    refs = llava_engine.generate(messages=list(chats.values()),
                                 sampling_params=SamplingParams(max_new_tokens=6, temperature=0))
    out = {x["custom_id"]: x for x in map(json.loads, oai.files.content(b.output_file_id).text.splitlines())}
    assert list(out) == list(chats)  # input order, the bad line left out
    for (cid, _), ref in zip(chats.items(), refs):
        body = out[cid]["response"]["body"]
        assert out[cid]["response"]["status_code"] == 200 and body["model"] == "tiny-llava"
        assert body["choices"][0]["message"]["content"] == ref.samples[0].text, cid
        assert body["usage"]["completion_tokens"] == len(ref.samples[0].token_ids)
        assert body["usage"]["prompt_tokens"] == ref.samples[0].usage.prompt_tokens  # image tokens counted
    # The same tokens, through the batch's job (extension: GET /v1/jobs/{job id}/results).
    with Client(vision_service[0]) as c:
        items = c.results(b.id.removeprefix("batch_"))
    assert [it["samples"][0]["token_ids"] for it in items if it["custom_id"] != "bad"] == \
        [r.samples[0].token_ids for r in refs]
    [err] = [json.loads(x) for x in oai.files.content(b.error_file_id).text.splitlines()]
    assert err["custom_id"] == "bad" and err["error"] is None and err["response"]["status_code"] == 400
    message = err["response"]["body"]["error"]["message"]
    assert "image 0: not a decodable PNG, JPEG or WebP image" in message, message


def sse_text(events, index=0):
    """The text of sample 0 of item `index`, from the deltas alone, and how many entries had some."""
    pieces = [e["delta"] for _, e in events if e["type"] in ("delta", "final") and e["index"] == index
              and e["sample"] == 0 and e["delta"]]
    return "".join(pieces), len(pieces)


def test_streams_with_images_equal_the_whole_answer(vision_service, llava_engine, oai):
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    chats = [chat(data_url(w=36, h=30, seed=6), "tell me"), chat(data_url(seed=7, fmt="JPEG"), "more")]
    refs = llava_engine.generate(messages=chats, sampling_params=SamplingParams(**sp))
    # Native: the job's SSE events; each item's deltas add up to its stored result.
    with Client(vision_service[0]) as c:
        job = c.submit(messages=chats, sampling_params=sp)
        events = list(c.events(job["id"], timeout=60))
        items = c.results(job["id"])
    assert events[-1][1]["status"] == "succeeded"
    for i, ref in enumerate(refs):
        text, pieces = sse_text(events, i)
        assert pieces >= 2, events  # really streamed, not one final entry
        assert text == items[i]["samples"][0]["text"] == ref.samples[0].text
        ids = [t for _, e in events if e["type"] in ("delta", "final") and e["index"] == i for t in e["delta_ids"]]
        assert ids == items[i]["samples"][0]["token_ids"] == ref.samples[0].token_ids
    # OpenAI: stream=True with an image; the chunks' content adds up to the non-streamed answer.
    kw = dict(model="tiny-llava", messages=chats[0], max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) >= 2, chunks
    assert "".join(content) == whole.choices[0].message.content == refs[0].samples[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_text_model_refuses_image_parts_by_name(api_url, worker):
    """The session's text model (its worker announces no images): an image part is refused
    where the API can see it, naming the part; online a 400, in a batch a validation failure
    of the line (the batch fails whole at creation, as for every line that does not fit the
    batch: OpenAI's validating stage); a native job's image item fails alone in the worker."""
    from openai import BadRequestError, OpenAI
    image = chat(data_url(seed=8))
    with OpenAI(base_url=api_url + "/v1", api_key="x", max_retries=0, timeout=60) as oai:
        with pytest.raises(BadRequestError) as e:
            oai.chat.completions.create(model="llama", messages=image, max_tokens=2)
        assert (e.value.body["param"], e.value.body["code"]) == ("messages[0].content[0]", "unsupported_parameter")
        assert "not supported by the model 'llama'" in e.value.body["message"]
        b = run_batch(oai, [batch_line("text", [{"role": "user", "content": "hi"}], model="llama", max_tokens=2),
                            batch_line("image", [{"role": "user", "content": "look"}, *image], model="llama",
                                       max_tokens=2)])
    assert b.status == "failed" and b.output_file_id is None and b.error_file_id is None
    [err] = b.errors.data
    assert (err.code, err.line, err.param) == ("unsupported_parameter", 2, "body.messages[1].content[0]")
    assert "image_url parts are not supported by the model 'llama'" in err.message, err.message
    with Client(api_url) as c:
        items = c.run(messages=[[{"role": "user", "content": "hi"}], image], sampling_params={"max_new_tokens": 2},
                      timeout=60)
    assert items[0]["samples"][0]["finish_reason"] in ("length", "stop"), items[0]
    assert items[1]["samples"][0]["finish_reason"] == "error", items[1]
    assert "this model does not take images" in items[1]["samples"][0]["error"]


def test_fanout_generate_offline_takes_images(llava, llava_engine, tmp_path):
    """`fanout generate` runs a messages file as the worker does: the engine renders the chats,
    so images are expanded and decoded (a bad one fails its item alone)."""
    from cli.main import main
    chats = [chat(data_url(seed=9), "what"), [{"role": "user", "content": "only text"}],
             chat("data:image/png;base64,bm90IGFuIGltYWdl")]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    main(["generate", str(src), str(out), "--model", llava, "--device", "cpu", "--max-new-tokens", "6",
          "--temperature", "0"])
    rows = [json.loads(line)["samples"][0] for line in out.read_text().rstrip("\n").split("\n")]
    refs = llava_engine.generate(messages=chats[:2], sampling_params=SamplingParams(max_new_tokens=6, temperature=0))
    assert [r["token_ids"] for r in rows[:2]] == [ref.samples[0].token_ids for ref in refs]
    assert rows[0]["usage"]["prompt_tokens"] == refs[0].samples[0].usage.prompt_tokens  # the image's tokens
    assert rows[2]["finish_reason"] == "error" and "image 0" in rows[2]["error"], rows[2]


# -- image URLs other than data URLs ---------------------------------------------------------

def test_the_worker_announces_the_schemes_it_takes(vision_service):
    conn = redis_lib.Redis.from_url(vision_service[1])
    entry = json.loads(conn.hget(keys.models(), "tiny-llava"))
    conn.close()
    assert entry["images"] == ["data", "http", "https"]


def test_downloaded_images_equal_data_urls_and_a_bad_url_fails_alone(vision_service, llava_engine, image_server, oai):
    url, redis_url = vision_service
    image_server.files["seed3.png"] = image(seed=3)
    ref = llava_engine.generate(messages=[chat(data_url(seed=3))], sampling_params=SamplingParams(**SP),
                                seed=7)[0].samples[0]
    with Client(url) as c:
        job = c.submit(messages=[chat(data_url(seed=3)), chat(image_server.url + "/f/seed3.png"),
                                 chat(image_server.url + "/missing.png"), chat("file:///etc/hostname")],
                       sampling_params=SP, seed=7)
        follow(redis_url, job["id"])
        info, items = c.status(job["id"]), c.results(job["id"])
    assert info["status"] == "succeeded" and info["progress"]["failed"] == 2, info
    for item in items[:2]:
        s = item["samples"][0]
        assert s["finish_reason"] != "error" and s["token_ids"] == ref.token_ids, s
    missing, local = (items[i]["samples"][0] for i in (2, 3))
    assert missing["finish_reason"] == "error" and "HTTP 404" in missing["error"], missing
    assert local["finish_reason"] == "error" and "--image-file-root" in local["error"], local
    # The OpenAI route takes the download too.
    r = oai.chat.completions.create(model="tiny-llava", messages=chat(image_server.url + "/f/seed3.png"),
                                    max_tokens=SP["max_new_tokens"], temperature=0)
    assert r.choices[0].message.content == ref.text


def test_a_slow_download_holds_up_only_its_own_job(vision_service, image_server):
    url, redis_url = vision_service
    with Client(url) as c:
        slow = c.submit(messages=[chat(slow_url(image_server, "slow.png", 4))], sampling_params=SP, seed=7)
        time.sleep(0.5)  # the worker has taken the slow job and is downloading its image
        quick = c.submit(messages=[[{"role": "user", "content": "hello"}]], sampling_params=SP, seed=7)
        follow(redis_url, quick["id"])
        quick_done = time.monotonic()
        follow(redis_url, slow["id"])
        assert c.status(quick["id"])["status"] == "succeeded"
        assert c.status(slow["id"])["status"] == "succeeded"
    # The text job ran while the image was still downloading.
    assert "slow.png" in image_server.served_at and quick_done < image_server.served_at["slow.png"]


def test_a_job_canceled_while_its_image_downloads_ends_at_once(vision_service, image_server):
    url, redis_url = vision_service
    with Client(url) as c:
        job = c.submit(messages=[chat(slow_url(image_server, "slow2.png", 5))], sampling_params=SP, seed=7)
        time.sleep(0.5)  # the worker is downloading its image
        c.cancel(job["id"])
        follow(redis_url, job["id"])
        assert c.status(job["id"])["status"] == "canceled"
    assert "slow2.png" not in image_server.served_at, "the job ended only once its image came"


def test_a_redirect_to_another_port_of_the_allowed_host_is_refused(vision_service, image_server):
    """SSRF by port: the worker may fetch from 127.0.0.1:<the image server's port>; a redirect
    from there to another port of 127.0.0.1 (a listener standing in for Redis) fails its item
    before connecting, and its batch-mate runs."""
    url, redis_url = vision_service
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        with Client(url) as c:
            job = c.submit(messages=[chat(f"{image_server.url}/redirect?http://127.0.0.1:{port}/"),
                                     chat(data_url(seed=2))], sampling_params=SP, seed=7)
            follow(redis_url, job["id"])
            info, items = c.status(job["id"]), c.results(job["id"])
        assert info["status"] == "succeeded" and info["progress"]["failed"] == 1, info
        bad, good = items[0]["samples"][0], items[1]["samples"][0]
        assert bad["finish_reason"] == "error" and f"'127.0.0.1:{port}' is not among the allowed hosts" in bad["error"]
        assert good["finish_reason"] != "error"
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected
    finally:
        listener.close()


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def test_decoding_counts_against_the_image_memory(vision_service, image_server):
    """Big images, small files: six distinct 4096x4096 PNGs (64 MiB each decoded) decode
    within --image-memory (200 MB here) and the worker's peak memory grows by about that,
    not by the six; one 8192x7000 (229 MB decoded) fails alone, before it is decoded.
    (Before: every image of a load stayed decoded until the load ended; 16 distinct 8192²
    PNGs took a worker from 628 MB to 5.2 GB.)"""
    url, redis_url = vision_service
    pid = worker_pid(redis_url)
    names = []
    for k in range(6):
        img = PILImage.new("RGB", (4096, 4096), (k * 40, 90, 200))
        img.putpixel((k, k), (255, 255, 255))
        buf = io.BytesIO()
        img.save(buf, "PNG")
        image_server.files[f"big{k}.png"] = buf.getvalue()
        names.append(f"big{k}.png")
    buf = io.BytesIO()
    PILImage.new("RGB", (8192, 7000), (1, 2, 3)).save(buf, "PNG")
    image_server.files["huge.png"] = buf.getvalue()
    before = peak_rss_mb(pid)
    with Client(url) as c:
        job = c.submit(messages=[chat(f"{image_server.url}/f/{n}") for n in names + ["huge.png"]],
                       sampling_params=SP, seed=7)
        follow(redis_url, job["id"])
        info, items = c.status(job["id"]), c.results(job["id"])
    grew = peak_rss_mb(pid) - before
    assert info["progress"]["failed"] == 1, info
    assert all(it["samples"][0]["finish_reason"] != "error" for it in items[:6])
    huge = items[6]["samples"][0]
    assert huge["finish_reason"] == "error" and "--image-memory" in huge["error"], huge
    assert grew < IMAGE_MEMORY / 2**20 + 150, grew  # six at once would be over 700 MB
    print(f"six 4096² images and a refused 8192x7000: worker peak RSS +{grew:.0f} MB "
          f"(--image-memory {IMAGE_MEMORY / 2**20:.0f} MiB)")
