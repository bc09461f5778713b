"""Many models, one fleet: jobs routed by model (jobs/models.py, jobs.spec.queues).

Its own Redis, one API and two workers serving two different random-weight models, the
first with two LoRA adapters made by peft; a third model the API knows (FANOUT_MODELS) but
no worker serves until the test starts one. An adapter's outputs are compared with the
engine's on the same adapter, which tests/test_lora.py compares with transformers + peft."""
from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
import redis as redis_lib

from cli.redis_server import EmbeddedRedis
from conftest import WorkerProc, entries, follow_stream, start_api, wait_for
from jobs import models as fleet
from results import keys
from test_openai_batch import chat_line, jsonl, read_lines, wait
from worker.engine import Engine, SamplingParams
from worker.engine.models.tiny import build_tiny_lora, build_tiny_model

PROMPTS = ["the quick brown fox", "a b c d e f", "one two three"]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
TTL = 6  # the workers' heartbeat TTL (FANOUT_HEARTBEAT_TTL): a dead one's shards are reaped after it


@pytest.fixture(scope="module")
def fleet_of_two(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("routing")
    other = build_tiny_model(str(root / "qwen"), arch="qwen3", seed=7)
    adapters = {"a1": build_tiny_lora(model_dir, str(root / "a1"), 1),
                "a2": build_tiny_lora(model_dir, str(root / "a2"), 2, r=4, lora_alpha=8,
                                      target_modules=["q_proj", "v_proj", "down_proj"])}
    server = EmbeddedRedis()
    api, url = start_api(server.url, root, "api", env={"FANOUT_MODELS": "late"})
    lora = ["--lora", *(f"{k}={v}" for k, v in adapters.items())]
    env = {"FANOUT_HEARTBEAT_TTL": str(TTL)}
    workers = {"llama": WorkerProc(server.url, model_dir, root, args=lora, env=env),
               "qwen": WorkerProc(server.url, other, root, env=env)}
    for w in workers.values():
        w.start()
    r = redis_lib.Redis.from_url(server.url)
    yield {"url": url, "redis": r, "workers": workers, "dirs": {"llama": model_dir, "qwen": other}, "adapters": adapters,
           "server": server, "root": root, "api": api}
    for w in workers.values():
        if w.proc is not None and w.proc.alive():
            w.stop()
    api.stop()
    server.stop()


@pytest.fixture(scope="module")
def engines(fleet_of_two):
    out = {name: Engine(path, device="cpu") for name, path in fleet_of_two["dirs"].items()}
    out["lora"] = Engine(fleet_of_two["dirs"]["llama"], lora=[f"{k}={v}" for k, v in fleet_of_two["adapters"].items()])
    return out


def greedy(engine: Engine, prompts, lora: str | None = None) -> list[list[int]]:
    items = engine.generate(prompts=prompts, sampling_params=SamplingParams(**GREEDY), lora=lora)
    return [it.samples[0].token_ids for it in items]


def ran_on(r, job_id: str) -> set[str]:
    """The workers that ran the job's shards (its stream's attempt entries)."""
    return {e["worker"] for e in entries(r, job_id) if e["type"] == "attempt"}


def finished(url: str, job_id: str, timeout: float = 60) -> dict:
    return wait_for(lambda: (j := httpx.get(f"{url}/v1/jobs/{job_id}").json())["status"] in
                    ("succeeded", "failed", "canceled") and j, timeout, f"job {job_id}")


def tokens_of(url: str, job_id: str) -> list[list[int]]:
    page = httpx.get(f"{url}/v1/jobs/{job_id}/results").json()
    return [it["samples"][0]["token_ids"] for it in page["items"]]


def test_models_lists_both_and_a_job_names_its_model(fleet_of_two):
    url = fleet_of_two["url"]
    listed = httpx.get(url + "/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in listed] == [("a1", "llama"), ("a2", "llama"), ("llama", None),
                                                         ("qwen", None)]  # `late`: known, not served
    r = httpx.post(url + "/v1/jobs", json={"prompts": PROMPTS})
    assert r.status_code == 400 and "several models (a1, a2, llama, qwen)" in r.json()["detail"], r.text
    r = httpx.post(url + "/v1/jobs", json={"prompts": PROMPTS, "model": "nope"})
    assert r.status_code == 404 and "'nope'" in r.json()["detail"] and "a1, a2, llama, qwen" in r.json()["detail"], r.text


def test_each_models_jobs_run_on_its_workers_alone(fleet_of_two, engines):
    url, r, workers = fleet_of_two["url"], fleet_of_two["redis"], fleet_of_two["workers"]
    ids = {}
    for name in ("llama", "qwen"):
        for k in range(3):  # several jobs each, submitted before any ends: any idle worker could take them
            resp = httpx.post(url + "/v1/jobs", json={"prompts": PROMPTS, "model": name, "sampling_params": GREEDY})
            assert resp.status_code == 202, resp.text
            ids[name, k] = resp.json()["id"]
    for (name, _), job_id in ids.items():
        job = finished(url, job_id)
        assert job["status"] == "succeeded" and job["model"] == name and job["waiting"] is None, job
        assert ran_on(r, job_id) == {workers[name].ref}
        assert tokens_of(url, job_id) == greedy(engines[name], PROMPTS)
    assert greedy(engines["llama"], PROMPTS) != greedy(engines["qwen"], PROMPTS)  # the test can tell them apart


def test_openai_requests_run_on_the_model_they_name(fleet_of_two):
    url, r, workers = fleet_of_two["url"], fleet_of_two["redis"], fleet_of_two["workers"]
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as oai:
        for name in ("llama", "qwen"):
            c = oai.completions.create(model=name, prompt=PROMPTS[0], max_tokens=4, temperature=0)
            assert c.model == name
            assert ran_on(r, c.id.removeprefix("cmpl-")) == {workers[name].ref}
        with pytest.raises(openai.NotFoundError) as e:
            oai.completions.create(model="nope", prompt="x", max_tokens=2)
        assert e.value.code == "model_not_found" and "llama, qwen" in e.value.message
        c = oai.completions.create(model="a2", prompt=PROMPTS[0], max_tokens=4, temperature=0)
        assert c.model == "a2" and ran_on(r, c.id.removeprefix("cmpl-")) == {workers["llama"].ref}


def test_a_batch_for_a_model_no_worker_serves_yet_waits_and_completes(fleet_of_two, engines):
    """FANOUT_MODELS names `late`: its batch and job are taken, wait queued saying why, and run
    once a worker serving it starts."""
    url, r, root = fleet_of_two["url"], fleet_of_two["redis"], fleet_of_two["root"]
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as oai:
        lines = [chat_line(f"q{i}", p, max_tokens=4, temperature=0) for i, p in enumerate(PROMPTS)]
        for line in lines:
            line["body"]["model"] = "late"
        f = oai.files.create(file=("late.jsonl", jsonl(lines)), purpose="batch")
        b = wait(oai, oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id, ("in_progress", "failed"))
        assert b.status == "in_progress" and b.model == "late", b
        [why] = b.errors.data
        assert why.code == "model_not_served" and "'late'" in why.message
        native = httpx.post(url + "/v1/jobs", json={"prompts": PROMPTS, "model": "late", "sampling_params": GREEDY})
        assert native.status_code == 202, native.text
        job = httpx.get(f"{url}/v1/jobs/{native.json()['id']}").json()
        assert job["status"] == "queued" and "no live worker serves the model 'late'" in job["waiting"], job
        time.sleep(2)  # nothing takes them meanwhile
        assert oai.batches.retrieve(b.id).status == "in_progress"
        late = WorkerProc(fleet_of_two["server"].url, fleet_of_two["dirs"]["llama"], root,
                          args=["--served-model-name", "late"])
        late.start()
        try:
            b = wait(oai, b.id, ("completed", "failed", "expired"), timeout=120)
            assert b.status == "completed" and b.errors is None and b.request_counts.completed == 3, b
            assert [x["custom_id"] for x in read_lines(oai, b.output_file_id)] == ["q0", "q1", "q2"]
            job = finished(url, native.json()["id"])
            assert job["status"] == "succeeded" and job["waiting"] is None
            assert ran_on(r, native.json()["id"]) == {late.ref}
            assert tokens_of(url, native.json()["id"]) == greedy(engines["llama"], PROMPTS)
        finally:
            late.stop()


def test_a_batch_created_while_its_models_worker_loads_completes(fleet_of_two):
    """The case that failed every line with model_not_found: a batch for a model whose only
    worker is starting. The worker announces its model before loading it; the batch is taken
    as soon as that is in, and completes once the worker is up."""
    url, r, root = fleet_of_two["url"], fleet_of_two["redis"], fleet_of_two["root"]
    fresh = WorkerProc(fleet_of_two["server"].url, fleet_of_two["dirs"]["qwen"], root,
                       args=["--served-model-name", "fresh"])
    fresh.start(wait=False)
    try:
        wait_for(lambda: r.hget(keys.models(), "fresh"), 60, "the worker to announce its model")
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as oai:
            lines = [{**chat_line(f"q{i}", p, max_tokens=4, temperature=0)} for i, p in enumerate(PROMPTS)]
            for line in lines:
                line["body"]["model"] = "fresh"
            f = oai.files.create(file=("fresh.jsonl", jsonl(lines)), purpose="batch")
            b = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            b = wait(oai, b.id, ("completed", "failed", "expired"), timeout=120)
            assert b.status == "completed" and b.request_counts.completed == 3, b
    finally:
        fresh.stop()


def test_a_starting_worker_makes_its_model_known_before_it_has_loaded(fleet_of_two):
    r = fleet_of_two["redis"]
    assert fleet.get(r, "warming") is None
    assert fleet.announce_loading(r, "warming", "generate")
    m = fleet.get(r, "warming")
    assert m.state == "loading" and m.task == "generate" and not m.live
    assert "a worker is loading the model 'warming'" in fleet.waiting(m, "warming")
    assert not fleet.announce_loading(r, "llama", "generate")  # live: its entry is left as it is
    assert fleet.get(r, "llama").live
    r.hdel(keys.models(), "warming")
    # A loading model takes jobs (they wait), and is not listed among the served ones.
    url = fleet_of_two["url"]
    fleet.announce_loading(r, "warming", "generate")
    try:
        resp = httpx.post(url + "/v1/jobs", json={"prompts": ["x"], "model": "warming"})
        assert resp.status_code == 202, resp.text
        assert "loading" in httpx.get(f"{url}/v1/jobs/{resp.json()['id']}").json()["waiting"]
        assert "warming" not in [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        assert httpx.post(f"{url}/v1/jobs/{resp.json()['id']}/cancel").status_code == 202
    finally:
        r.hdel(keys.models(), "warming")


def test_an_embedding_route_refuses_a_text_model_by_name(fleet_of_two):
    url = fleet_of_two["url"]
    r = httpx.post(url + "/v1/embeddings", json={"model": "qwen", "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text
    r = httpx.post(url + "/v1/jobs", json={"prompts": ["x"], "task": "embed"})
    assert r.status_code == 404 and "task embed" in r.json()["detail"], r.text
    assert json.loads(fleet_of_two["redis"].hget(keys.models(), "qwen"))["task"] == "generate"


def test_fanout_submit_names_the_model(fleet_of_two, engines, tmp_path, capsys):
    from cli.main import main

    url, r, workers = fleet_of_two["url"], fleet_of_two["redis"], fleet_of_two["workers"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    main(["submit", str(src), "--url", url, "--model", "qwen", "--max-new-tokens", "8", "--temperature", "0",
          "--ignore-eos", "--out", str(out)])
    job_id = re.search(r"job (\w+)", capsys.readouterr().err).group(1)
    assert ran_on(r, job_id) == {workers["qwen"].ref}
    got = [json.loads(x)["samples"][0]["token_ids"] for x in out.read_text().splitlines()]
    assert got == greedy(engines["qwen"], PROMPTS)


def test_adapter_jobs_run_on_their_base_models_workers_mixed_with_it(fleet_of_two, engines):
    """Jobs for the base and both adapters, submitted together: the base's worker runs them
    (in shared steps), each with its adapter's tokens."""
    url, r, workers = fleet_of_two["url"], fleet_of_two["redis"], fleet_of_two["workers"]
    params = {**GREEDY, "max_new_tokens": 24}
    ids = {}
    for name in ("a1", "a2", "llama"):
        resp = httpx.post(url + "/v1/jobs", json={"prompts": PROMPTS, "model": name, "sampling_params": params})
        assert resp.status_code == 202, resp.text
        ids[name] = resp.json()["id"]
    together = 0
    for name, job_id in ids.items():
        job = finished(url, job_id)
        assert job["status"] == "succeeded" and job["model"] == name, job
        assert ran_on(r, job_id) == {workers["llama"].ref}
        want = engines["lora"].generate(prompts=PROMPTS, sampling_params=SamplingParams(**params),
                                        lora=None if name == "llama" else name)
        assert tokens_of(url, job_id) == [it.samples[0].token_ids for it in want], name
        together = max(together, job["batching"]["max_batch_jobs"])
    assert together >= 2  # adapters' and the base's requests shared steps
    assert greedy(engines["lora"], PROMPTS, "a1") != greedy(engines["lora"], PROMPTS)
    tok = httpx.post(url + "/tokenize", json={"model": "a1", "prompt": "hi"})  # its base's tokenizer
    assert tok.status_code == 200 and tok.json()["tokens"] == \
        httpx.post(url + "/tokenize", json={"model": "llama", "prompt": "hi"}).json()["tokens"]


def test_a_models_last_worker_killed_its_job_waits_and_resumes_on_the_next(fleet_of_two, engines):
    """kill -9 of the only worker of `qwen` mid-job: the other model's worker reaps the shard
    within the heartbeat TTL (it is queued again, not left running on a dead worker), the job
    says it waits for a worker of its model, and a new `qwen` worker finishes it with the
    outputs it would have had."""
    import signal

    url, r, workers = fleet_of_two["url"], fleet_of_two["redis"], fleet_of_two["workers"]
    params = {**GREEDY, "max_new_tokens": 400}
    job_id = httpx.post(url + "/v1/jobs", json={"prompts": PROMPTS, "model": "qwen", "sampling_params": params}).json()["id"]
    follow_stream(r, job_id)
    wait_for(lambda: any(e["type"] == "delta" for e in entries(r, job_id)), 60, "its samples to stream")
    workers["qwen"].stop(signal.SIGKILL)
    killed = time.monotonic()
    job = wait_for(lambda: (j := httpx.get(f"{url}/v1/jobs/{job_id}").json())["status"] == "queued"
                   and j["waiting"] and j, 3 * TTL + 10, "the shard reaped and the job waiting")
    assert "no live worker serves the model 'qwen'" in job["waiting"], job
    assert time.monotonic() - killed < 3 * TTL + 10  # the heartbeat TTL, twice (model and shard), and a reap
    workers["qwen"].start()
    job = finished(url, job_id, 120)
    assert job["status"] == "succeeded" and job["waiting"] is None and job["attempt"] == 2, job
    want = engines["qwen"].generate(prompts=PROMPTS, sampling_params=SamplingParams(**params))
    assert tokens_of(url, job_id) == [it.samples[0].token_ids for it in want]
