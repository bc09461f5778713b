"""Embeddings through the service, against sentence-transformers' `encode` on the same weights
(all-MiniLM-L6-v2, the embedding demo model): the official `openai` client's
embeddings.create (its default base64 encoding and floats), token ids, an input too long
(a 400 naming it) or truncated when asked, `dimensions` refused for a model not trained for
them; a native embedding job's results and /output (JSONL, and Parquet with a fixed-size
vector column); /v1/embeddings as a batch endpoint; generation and embedding models each
refused on the other's routes."""
import io
import json

import httpx
import openai
import pytest
import torch

from conftest import own_service, wait_for
from test_openai_batch import jsonl, wait
from worker.engine.models import demo

NAME = "minilm"
TEXTS = ["The cat sits on the mat.", "Embeddings map text to vectors.", "a", "Ünïcödé 🙂 中文"]
LONG = "word " * 300  # 302 tokens: past MiniLM's 256


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with own_service(demo.fetch_embedding_model(), tmp_path_factory.mktemp("embeddings"), NAME) as (url, _):
        yield url


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(demo.fetch_embedding_model(), device="cpu")
    return lambda texts: model.encode(texts, convert_to_tensor=True).cpu()


@pytest.fixture
def oai(served):
    with openai.OpenAI(base_url=served + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def tokens(oai, text: str) -> list[int]:
    """The model's token ids of `text` (the API's /tokenize: special tokens included)."""
    r = httpx.post(str(oai.base_url).removesuffix("v1/") + "tokenize", json={"model": NAME, "prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def cosines(got, want) -> list[float]:
    return torch.nn.functional.cosine_similarity(torch.tensor(got, dtype=torch.float64), want.double()).tolist()


def test_the_openai_client_gets_sentence_transformers_vectors(oai, reference):
    want = reference(TEXTS)
    r = oai.embeddings.create(model=NAME, input=TEXTS)  # the SDK asks base64 and decodes it
    assert r.object == "list" and r.model == NAME and [d.index for d in r.data] == [0, 1, 2, 3]
    assert min(cosines([d.embedding for d in r.data], want)) >= 0.9999
    tok = oai.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="float")
    assert len(tok.data) == 1 and len(tok.data[0].embedding) == 384
    assert cosines([tok.data[0].embedding], want[:1])[0] >= 0.9999
    ids = tokens(oai, TEXTS[0])
    assert tok.usage.prompt_tokens == tok.usage.total_tokens == len(ids)
    by_ids = oai.embeddings.create(model=NAME, input=ids, encoding_format="float")
    assert cosines([by_ids.data[0].embedding], want[:1])[0] >= 0.9999 and by_ids.usage.prompt_tokens == len(ids)


def test_an_input_too_long_is_named_unless_truncated(oai, reference):
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(model=NAME, input=[TEXTS[0], LONG])
    assert e.value.body["param"] == "input[1]" and "302 tokens, over the model's 256" in e.value.body["message"]
    r = oai.embeddings.create(model=NAME, input=[TEXTS[0], LONG], extra_body={"truncate_prompt_tokens": -1})
    assert min(cosines([d.embedding for d in r.data], reference([TEXTS[0], LONG]))) >= 0.9999  # it truncates too
    assert r.usage.prompt_tokens == len(tokens(oai, TEXTS[0])) + 256
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(model=NAME, input="hi", dimensions=64)
    assert e.value.body["param"] == "dimensions" and "not trained for shorter vectors" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(model=NAME, input=[])
    assert e.value.body["param"] == "input"


def test_a_generation_route_refuses_an_embedding_model(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_supported" and "/v1/embeddings" in e.value.body["message"]


def test_a_native_embedding_job_and_its_output(served, reference):
    want = reference(TEXTS)
    r = httpx.post(served + "/v1/jobs", json={"task": "embed", "prompts": TEXTS, "custom_ids": ["a", "b", "c", "d"]})
    assert r.status_code == 202, r.text
    job = r.json()["id"]
    wait_for(lambda: httpx.get(f"{served}/v1/jobs/{job}").json()["status"] == "succeeded", 60, "the job")
    info = httpx.get(f"{served}/v1/jobs/{job}").json()
    assert info["task"] == "embed" and info["progress"]["done"] == 4 and info["model"] == NAME
    items = httpx.get(f"{served}/v1/jobs/{job}/results").json()["items"]
    assert min(cosines([it["samples"][0]["embedding"] for it in items], want)) >= 0.9999
    lines = [json.loads(x) for x in httpx.get(f"{served}/v1/jobs/{job}/output").text.splitlines()]
    assert [x["custom_id"] for x in lines] == ["a", "b", "c", "d"]
    assert min(cosines([x["samples"][0]["embedding"] for x in lines], want)) >= 0.9999
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = pq.read_table(io.BytesIO(httpx.get(f"{served}/v1/jobs/{job}/output?format=parquet").content))
    vector = table.schema.field("samples").type.value_type.field("embedding").type
    assert vector == pa.list_(pa.float32(), 384)  # a fixed-size list column
    rows = table.to_pylist()
    assert min(cosines([row["samples"][0]["embedding"] for row in rows], want)) >= 0.9999


def test_a_native_embedding_job_is_checked(served):
    for body, where in (({"task": "embed", "messages": [[{"role": "user", "content": "hi"}]]}, "messages"),
                        ({"task": "embed", "prompts": ["hi"], "sampling_params": {"n": 2}}, "sampling_params"),
                        ({"prompts": ["hi"], "embed": {"dimensions": 8}}, "embed"),
                        ({"task": "embed", "prompts": ["hi"], "embed": {"truncate_prompt_tokens": 0}},
                         "truncate_prompt_tokens")):
        r = httpx.post(served + "/v1/jobs", json=body)
        assert r.status_code == 422 and where in r.text, (body, r.text)


def test_an_embeddings_batch(oai, reference):
    def line(custom_id, x):
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
                "body": {"model": NAME, "input": x, "encoding_format": "base64"}}

    lines = [line(f"t{i}", t) for i, t in enumerate(TEXTS)] + [line("long", LONG)]
    f = oai.files.create(file=("e.jsonl", jsonl(lines)), purpose="batch")
    b = oai.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    b = wait(oai, b.id, ("completed", "failed", "expired", "cancelled"))
    assert b.status == "completed", b
    assert (b.request_counts.completed, b.request_counts.failed) == (4, 1)
    out = {x["custom_id"]: x["response"]["body"] for x in map(json.loads, oai.files.content(b.output_file_id).text.splitlines())}
    import numpy as np
    got = [np.frombuffer(__import__("base64").b64decode(out[f"t{i}"]["data"][0]["embedding"]), "<f4").tolist()
           for i in range(4)]
    assert min(cosines(got, reference(TEXTS))) >= 0.9999
    assert all(out[f"t{i}"]["object"] == "list" and out[f"t{i}"]["usage"]["prompt_tokens"] > 0 for i in range(4))
    [err] = map(json.loads, oai.files.content(b.error_file_id).text.splitlines())
    assert err["custom_id"] == "long" and "302 tokens" in err["response"]["body"]["error"]["message"]
    mixed = [line("a", "x"), {**line("b", "y"), "body": {"model": NAME, "input": "y", "dimensions": 64}}]
    f = oai.files.create(file=("m.jsonl", jsonl(mixed)), purpose="batch")
    b = oai.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    b = wait(oai, b.id, ("failed", "in_progress", "completed"))
    assert b.status == "failed" and b.errors.data[0].code == "mismatched_parameters" and b.errors.data[0].line == 2


def test_the_embeddings_route_refuses_a_generation_model(api_url, worker):
    with openai.OpenAI(base_url=api_url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        with pytest.raises(openai.BadRequestError) as e:
            c.embeddings.create(model="llama", input="hi")
    assert e.value.body["code"] == "model_not_supported" and "a text generation model" in e.value.body["message"]


def test_the_openapi_example_names_the_embedding_model_and_runs(served):
    spec = httpx.get(served + "/openapi.json").json()
    example = spec["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]["example"]
    assert example["model"] == NAME
    r = httpx.post(served + "/v1/embeddings", json=example, timeout=60)
    assert r.status_code == 200 and len(r.json()["data"]) == len(example["input"])
