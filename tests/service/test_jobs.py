"""End to end over real HTTP, a real Redis server and a real worker process."""
import json
import time
from datetime import datetime, timedelta, timezone

import httpx
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.worker import Worker

from results import keys, reader
from results.client import _parse_sse
from worker.engine import SamplingParams


PROMPTS = ["Hello", "def fibonacci(n):", "The quick brown fox jumps over the lazy dog, then",
           "import os\nimport sys\n\nclass Config:"]


def engine_ids(engine, seed, params, prompts=None, input_ids=None):
    items = engine.generate(prompts=prompts, input_ids=input_ids, sampling_params=params, seed=seed)
    return {(it.index, j): s.token_ids for it in items for j, s in enumerate(it.samples)}


def service_ids(items):
    return {(it["index"], s["sample"]): s["token_ids"] for it in items for s in it["samples"]}


def follow(redis, job_id, timeout=60):
    """Every stream entry from the start to the terminal status."""
    return list(reader.follow(redis, job_id, timeout=timeout))


def test_same_tokens_as_the_engine_and_the_stream_rebuilds_them(client, engine, redis):
    sp = {"max_new_tokens": 12, "n": 2, "temperature": 0.8, "top_p": 0.95}
    job = client.submit(prompts=PROMPTS, sampling_params=sp, seed=1234, metadata={"run": "e2e"})
    entries = follow(redis, job["id"])
    info = client.status(job["id"])
    assert info["status"] == "succeeded", info
    assert info["progress"] == {"total": 4, "done": 4, "failed": 0, "samples": 8, "samples_done": 8}
    assert info["usage"]["completion_tokens"] == 8 * 12 and info["attempt"] == 1
    items = client.results(job["id"])
    assert [it["index"] for it in items] == [0, 1, 2, 3]
    assert service_ids(items) == engine_ids(engine, 1234, SamplingParams(**sp), prompts=PROMPTS)

    # The stream alone rebuilds every output exactly.
    rb = reader.Rebuilder()
    for _, entry in entries:
        rb.apply(entry)
    assert rb.status == "succeeded"
    for it in items:
        for s in it["samples"]:
            out = rb.outputs[(it["index"], s["sample"])]
            assert (out.text, out.token_ids, out.finish_reason) == (s["text"], s["token_ids"], s["finish_reason"])
    kinds = [e["type"] for _, e in entries]
    assert kinds[:3] == ["status", "attempt", "status"] and kinds.count("final") == 8
    # Outputs arrive while they are generated, not only at the end.
    assert {(e["index"], e["sample"]) for _, e in entries if e["type"] == "delta"} == set(rb.outputs)


def test_chat_messages_use_the_tokenizer_template(client, engine, redis):
    chats = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}]]
    sp = {"max_new_tokens": 6, "temperature": 0}
    items = client.run(messages=chats, sampling_params=sp, timeout=60)  # submit, follow, fetch
    tok = engine.tokenizer
    ids = [tok(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"] for c in chats]
    assert ids[0].count(tok.bos_token_id) == 1
    assert service_ids(items) == engine_ids(engine, 0, SamplingParams(**sp), input_ids=ids)


def test_an_item_with_its_own_seed_gives_the_same_samples_in_any_job(client, engine, redis):
    own = {"max_new_tokens": 6, "n": 2, "temperature": 1.0, "seed": 99}
    rest = {"max_new_tokens": 6, "n": 2, "temperature": 1.0}
    first = client.submit(prompts=["Hello", "def fibonacci(n):"], sampling_params=[rest, own], seed=1)
    second = client.submit(prompts=["import os", "The quick", "def fibonacci(n):"],
                           sampling_params=[rest, rest, own], seed=2)
    for job in (first, second):
        follow(redis, job["id"])
    a, b = service_ids(client.results(first["id"])), service_ids(client.results(second["id"]))
    assert [a[(1, j)] for j in range(2)] == [b[(2, j)] for j in range(2)]
    # Equal to the engine's answer for that item alone, and its two samples differ.
    alone = engine.generate(prompts=["def fibonacci(n):"], sampling_params=[SamplingParams(**own)])[0]
    assert [s.token_ids for s in alone.samples] == [b[(2, j)] for j in range(2)]
    assert b[(2, 0)] != b[(2, 1)]
    # Items without their own seed follow the job seed: (seed, index, sample).
    ref = engine_ids(engine, 2, [SamplingParams(**rest)] * 2, prompts=["import os", "The quick"])
    assert {k: v for k, v in b.items() if k[0] < 2} == ref


def test_a_payload_that_does_not_parse_fails_at_once_without_retry(redis, worker):
    """A shard whose items do not parse (not written by our API) fails its job at its first
    attempt: retrying cannot help."""
    from datetime import datetime, timedelta, timezone

    from api import jobs
    from api.schemas import JobRequest
    from jobs.settings import Settings

    req = JobRequest(prompts=["a", "b"], sampling_params=[{"n": 1}, {"n": 2}], priority="high",
                     run_at=datetime.now(timezone.utc) + timedelta(seconds=2))
    job_id = jobs.submit(redis, req, Settings(result_ttl=3600, job_retries=2))["id"]
    redis.lset(keys.items(job_id), 0, json.dumps([{"x": "a", "p": {"n": "two"}}, {"x": "b", "p": {"n": 2}}]))
    events = follow(redis, job_id, timeout=30)
    assert events[-1][1]["status"] == "failed"
    assert "sampling_params.0.n" in events[-1][1]["error"], events
    assert [e["type"] for _, e in events].count("attempt") == 1
    assert not redis.exists(keys.items(job_id))  # the input goes once the job ended


def test_sse_resumes_after_a_dropped_connection_without_gap_or_duplicate(client, api_pair, redis):
    job = client.submit(prompts=PROMPTS, sampling_params={"max_new_tokens": 40, "ignore_eos": True})
    got = []
    # Drop the connection after a few events, then resume on the other API process.
    with httpx.Client(base_url=api_pair[0], timeout=30) as http:
        with http.stream("GET", f"/v1/jobs/{job['id']}/events") as r:
            for entry_id, entry in _parse_sse(r.iter_lines()):
                got.append((entry_id, entry))
                if len(got) == 7:
                    break
    with httpx.Client(base_url=api_pair[1], timeout=30) as http:
        with http.stream("GET", f"/v1/jobs/{job['id']}/events",
                         headers={"Last-Event-ID": got[-1][0]}) as r:
            got += list(_parse_sse(r.iter_lines()))
    assert got[-1][1] == {"type": "status", "status": "succeeded", "done": 4, "total": 4, "failed": 0}
    stored = [(i.decode(), f) for i, f in redis.xrange(keys.stream(job["id"]))]
    assert [i for i, _ in got] == [i for i, _ in stored]
    assert [e for _, e in got] == [reader.events.decode(f) for _, f in stored]
    # The client's own follower (reconnecting) sees the same.
    assert [i for i, _ in client.events(job["id"])] == [i for i, _ in stored]


def test_three_jobs_share_engine_batches(client, engine, redis):
    sp = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    jobs = [client.submit(prompts=PROMPTS[k:k + 2], sampling_params=sp) for k in range(3)]
    for j in jobs:
        follow(redis, j["id"])
    for k, j in enumerate(jobs):
        info = client.status(j["id"])
        assert info["status"] == "succeeded"
        # All three jobs had requests in one engine step (same forward batch).
        assert info["batching"]["max_batch_jobs"] == 3, info["batching"]
        # Greedy outputs do not depend on what else was in the batch.
        got = service_ids(client.results(j["id"]))
        assert got == engine_ids(engine, 0, SamplingParams(**sp), prompts=PROMPTS[k:k + 2])


def test_rq_sees_the_truth_while_running_and_after(client, redis, worker):
    """A small job is one shard, an rq job `<id>-0`: started while it runs, forgotten by rq
    once it ended (the job's own keys keep the outcome)."""
    job = client.submit(prompts=PROMPTS, sampling_params={"max_new_tokens": 60, "ignore_eos": True})
    rq_job = Job.fetch(job["id"] + "-0", connection=redis, serializer=JSONSerializer)
    it = reader.follow(redis, job["id"], timeout=60)
    next(e for _, e in it if e["type"] == "delta")
    assert rq_job.get_status() == "started"
    assert rq_job.id in StartedJobRegistry(rq_job.origin, connection=redis).get_job_ids()
    w = Worker.find_by_key(Worker.redis_worker_namespace_prefix + worker.name, connection=redis)
    assert w.get_state() == "busy"
    info = client.status(job["id"])
    assert info["status"] == "running"
    assert info["shards"] == {"total": 1, "queued": 0, "running": 1, "done": 0, "pending": 0,
                              "workers": [worker.ref]}
    for _ in it:
        pass
    assert not Job.exists(rq_job.id, connection=redis)
    assert rq_job.id not in StartedJobRegistry(rq_job.origin, connection=redis).get_job_ids()
    info = client.status(job["id"])
    assert info["progress"]["done"] == 4 and info["shards"]["done"] == 1 and info["shards"]["running"] == 0
    w.refresh()
    assert w.get_state() == "idle"


def test_cancel_mid_run_stops_within_one_step(client, redis):
    job = client.submit(prompts=PROMPTS, sampling_params={"max_new_tokens": 900, "ignore_eos": True})
    it = reader.follow(redis, job["id"], timeout=60)
    next(e for _, e in it if e["type"] == "delta")
    assert client.cancel(job["id"])["status"] in ("running", "canceled")
    mark = redis.xrevrange(keys.stream(job["id"]), count=1)[0][0].decode()
    rest = [e for _, e in it]
    assert rest[-1]["type"] == "status" and rest[-1]["status"] == "canceled"
    after = [reader.events.decode(f) for _, f in redis.xrange(keys.stream(job["id"]), min="(" + mark)]
    assert sum(e["type"] == "delta" for e in after) <= len(PROMPTS)  # at most the step in flight
    info = client.status(job["id"])
    assert info["status"] == "canceled" and info["progress"]["samples_done"] == 0
    assert info["usage"]["completion_tokens"] == 0
    assert not Job.exists(job["id"] + "-0", connection=redis)
    assert not StartedJobRegistry("fanout", connection=redis).get_job_ids()
    # The worker moves on: the next job runs.
    nxt = client.submit(prompts=["ok"], sampling_params={"max_new_tokens": 2})
    assert follow(redis, nxt["id"])[-1][1]["status"] == "succeeded"


def test_prompt_over_the_context_fails_that_item_alone(client, engine, redis):
    too_long = [7] * (engine.max_context + 5)
    job = client.submit(input_ids=[[5, 6, 7], too_long, [300, 1000], [9, 10]],
                        sampling_params={"max_new_tokens": 4, "n": 2, "temperature": 0})
    entries = [e for _, e in follow(redis, job["id"])]
    info = client.status(job["id"])
    assert info["status"] == "succeeded"
    assert info["progress"] == {"total": 4, "done": 4, "failed": 2, "samples": 8, "samples_done": 8}
    items = client.results(job["id"])
    for i in (1, 2):
        assert [s["finish_reason"] for s in items[i]["samples"]] == ["error", "error"]
    assert "context" in items[1]["samples"][0]["error"]
    assert "outside the vocabulary" in items[2]["samples"][0]["error"]
    errors = {(e["index"], e["sample"]) for e in entries if e["type"] == "error"}
    assert errors == {(1, 0), (1, 1), (2, 0), (2, 1)}
    for i in (0, 3):
        assert [len(s["token_ids"]) for s in items[i]["samples"]] == [4, 4]


def test_run_at_waits_as_scheduled(client, redis):
    run_at = datetime.now(timezone.utc) + timedelta(seconds=2)
    job = client.submit(prompts=["later"], sampling_params={"max_new_tokens": 2}, run_at=run_at.isoformat())
    assert job["status"] == "scheduled" and client.status(job["id"])["status"] == "scheduled"
    assert follow(redis, job["id"], timeout=30)[-1][1]["status"] == "succeeded"
    started = datetime.fromisoformat(client.status(job["id"])["started_at"].replace("Z", "+00:00"))
    assert started >= run_at


def test_sigterm_hands_jobs_back_and_the_retry_resumes(client, engine, redis, worker):
    """Item 0 finishes fast, item 1 is long: SIGTERM mid-job hands the job back; the next
    worker regenerates only item 1 (same seed) and the results match the engine's."""
    params = [{"max_new_tokens": 3, "temperature": 0.7}, {"max_new_tokens": 150, "temperature": 0.7,
                                                          "ignore_eos": True}]
    prompts = PROMPTS[:2]
    job = client.submit(prompts=prompts, sampling_params=params, seed=99)
    it = reader.follow(redis, job["id"], timeout=60)
    first = next(e for _, e in it if e["type"] == "final")
    assert first["index"] == 0
    t = time.monotonic()
    code = worker.stop()  # warm shutdown, drain timeout 0: hand back now
    try:
        assert code == 0, (code, f"{time.monotonic() - t:.1f} s", worker.proc.tail())
        rq_job = Job.fetch(job["id"] + "-0", connection=redis, serializer=JSONSerializer)
        assert rq_job.get_status() == "queued", rq_job.get_status()
        assert rq_job.get_position() == 0, redis.lrange(rq_job.origin and f"rq:queue:{rq_job.origin}", 0, -1)
        assert rq_job.id not in StartedJobRegistry(rq_job.origin, connection=redis).get_job_ids()
        info = client.status(job["id"])
        assert info["status"] == "queued" and info["progress"]["done"] == 1, info
        last = reader.events.decode(redis.xrevrange(keys.stream(job["id"]), count=1)[0][1])
        assert last == {"type": "status", "status": "queued", "error": "worker shut down; shard handed back"}
    finally:
        worker.start()  # the session's worker, whatever the checks above said
    entries = [e for _, e in reader.follow(redis, job["id"], timeout=60)]
    info = client.status(job["id"])
    assert info["status"] == "succeeded" and info["attempt"] == 2
    assert info["progress"]["done"] == 2
    second = entries[[e.get("attempt") for e in entries].index(2):]
    finals = [(e["index"], e["sample"]) for e in second if e["type"] == "final"]
    assert finals == [(1, 0)]  # item 0 was not recomputed
    rb = reader.Rebuilder()
    for e in entries:
        rb.apply(e)
    items = client.results(job["id"])
    assert rb.outputs[(1, 0)].token_ids == items[1]["samples"][0]["token_ids"]
    expected = engine_ids(engine, 99, [SamplingParams(**p) for p in params], prompts=prompts)
    assert service_ids(items) == expected
