"""OpenAI Files and Batches with the official `openai` client against the live service (real
API and worker processes, real Redis): a batch end to end, its lines equal to the engine's
own output; validation failures; cancel and expiry keep the finished lines."""
import json
import signal
import time

import httpx
import openai
import pytest
import redis as redis_lib

from api import tenants
from conftest import WorkerProc, start_api
from results import keys, reader
from cli.redis_server import EmbeddedRedis
from worker.engine import SamplingParams


@pytest.fixture
def oai(api_url, worker):
    with openai.OpenAI(base_url=api_url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def jsonl(lines) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(custom_id, content, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "llama", "messages": [{"role": "user", "content": content}], **body}}


def wait(oai, batch_id, statuses, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        b = oai.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        assert time.monotonic() < deadline, f"batch still {b.status} after {timeout}s"
        time.sleep(0.2)


def read_lines(oai, file_id):
    return [json.loads(line) for line in oai.files.content(file_id).text.splitlines()]


def chat_ids(engine, content):
    tok = engine.tokenizer
    return tok(tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def test_a_batch_runs_end_to_end_and_reads_as_from_openai(oai, engine, redis):
    texts = ["hi", "why is the sky blue?", "write a poem"]
    lines = [chat_line(f"greedy-{i}", t, max_tokens=6, temperature=0) for i, t in enumerate(texts)]
    lines.append(chat_line("sampled", "hello", max_tokens=5, n=2, seed=7, temperature=0.9, logprobs=True))
    lines.append(chat_line("too-long", "word " * 1100, max_tokens=2))  # over the tiny model's context
    data = jsonl(lines)
    f = oai.files.create(file=("requests.jsonl", data), purpose="batch")
    assert (f.object, f.purpose, f.bytes, f.status, f.filename) == ("file", "batch", len(data), "processed",
                                                                    "requests.jsonl")
    assert oai.files.retrieve(f.id).id == f.id and oai.files.content(f.id).content == data
    assert f.id in [x.id for x in oai.files.list()]

    b = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                           metadata={"run": "e2e"})
    assert b.status in ("in_progress", "finalizing", "completed") and b.input_file_id == f.id
    # Extension: its job streams every line's results with the line's custom_id.
    job_id = b.id.removeprefix("batch_")
    entries = [e for _, e in reader.follow(redis, job_id, timeout=120)]
    streamed = {e["custom_id"] for e in entries if e["type"] in ("delta", "final", "error")}
    if any(e["type"] == "trimmed" for e in entries):  # this follower came late: the shard had ended
        assert streamed <= {line["custom_id"] for line in lines}
    else:
        assert streamed == {line["custom_id"] for line in lines}
    b = wait(oai, b.id, ("completed",))
    assert b.request_counts.model_dump() == {"total": 5, "completed": 4, "failed": 1}
    assert b.created_at <= b.in_progress_at <= b.finalizing_at <= b.completed_at
    assert b.metadata == {"run": "e2e"} and b.model == "llama" and b.errors is None
    assert b.usage.output_tokens == 3 * 6 + 2 * 5

    out = {line["custom_id"]: line for line in read_lines(oai, b.output_file_id)}
    assert sorted(out) == ["greedy-0", "greedy-1", "greedy-2", "sampled"]
    for i, t in enumerate(texts):
        line = out[f"greedy-{i}"]
        assert line["error"] is None and line["response"]["status_code"] == 200 and line["id"].startswith("batch_req_")
        body = line["response"]["body"]
        ref = engine.generate(input_ids=[chat_ids(engine, t)],
                              sampling_params=SamplingParams(max_new_tokens=6, temperature=0))[0].samples[0]
        assert body["object"] == "chat.completion" and body["model"] == "llama"
        assert body["choices"][0]["message"]["content"] == ref.text
        assert body["usage"]["completion_tokens"] == 6
    # An item with its own seed: the same samples as the engine gives that request alone.
    ref = engine.generate(input_ids=[chat_ids(engine, "hello")], sampling_params=[SamplingParams(
        max_new_tokens=5, n=2, seed=7, temperature=0.9, logprobs=True)])[0]
    choices = out["sampled"]["response"]["body"]["choices"]
    assert [c["message"]["content"] for c in choices] == [s.text for s in ref.samples]
    assert [t["token"] for t in choices[1]["logprobs"]["content"]] == [x["token"] for x in ref.samples[1].logprobs]

    [error] = read_lines(oai, b.error_file_id)
    assert error["custom_id"] == "too-long" and error["response"]["status_code"] == 400
    assert "context" in error["response"]["body"]["error"]["message"]
    assert b.id == oai.batches.list(limit=1).data[0].id

    assert oai.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(f.id)


def test_invalid_files_and_batches_name_their_lines(oai):
    bad = [chat_line("a", "x"), chat_line("a", "y"), {"custom_id": "b", "method": "GET", "url": "/v1/completions",
                                                      "body": {}}, chat_line("c", "z", temperature=-1)]
    with pytest.raises(openai.BadRequestError) as e:
        oai.files.create(file=("bad.jsonl", jsonl(bad) + b"not json\n"), purpose="batch")
    msg = e.value.message
    assert all(f"line {n}" in msg for n in (2, 3, 4, 5)) and "line 1:" not in msg and e.value.param == "file"

    f = oai.files.create(file=("ok.jsonl", jsonl([chat_line("a", "x"), {
        "custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"model": "gpt-4o", "prompt": "p"}}])),
        purpose="batch")
    b = oai.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert b.status == "failed" and b.failed_at
    assert [(x.line, x.code) for x in b.errors.data] == [(1, "mismatched_endpoint"), (2, "model_not_found")]
    with pytest.raises(openai.NotFoundError):
        oai.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError) as e:
        oai.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                           extra_body={"output_expires_after": {"anchor": "created_at", "seconds": 3600}})
    assert e.value.param == "output_expires_after"


def slow_batch(oai, n=12, max_tokens=900):
    """Two quick lines, then lines long enough to be cut by a cancel, an expiry or a kill."""
    lines = [chat_line(f"quick-{i}", "hi", max_tokens=2) for i in range(2)]
    lines += [chat_line(f"slow-{i}", "tell me", max_tokens=max_tokens, ignore_eos=True) for i in range(n)]
    return lines, oai.files.create(file=("slow.jsonl", jsonl(lines)), purpose="batch")


def each_line_once(oai, b, lines, code):
    out = read_lines(oai, b.output_file_id)
    errors = read_lines(oai, b.error_file_id)
    assert sorted(x["custom_id"] for x in out + errors) == sorted(x["custom_id"] for x in lines)
    assert {"quick-0", "quick-1"} <= {x["custom_id"] for x in out}
    assert {x["error"]["code"] for x in errors} == {code} and all(x["response"] is None for x in errors)
    assert b.request_counts.completed == len(out) and b.request_counts.failed == len(errors) > 0
    assert b.request_counts.completed + b.request_counts.failed == b.request_counts.total == len(lines)
    return out


def test_cancel_keeps_the_finished_lines(oai):
    lines, f = slow_batch(oai)
    b = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while oai.batches.retrieve(b.id).request_counts.completed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert oai.batches.cancel(b.id).status in ("cancelling", "cancelled")
    b = wait(oai, b.id, ("cancelled",))
    assert b.cancelling_at <= b.cancelled_at
    out = each_line_once(oai, b, lines, "batch_cancelled")
    assert len(out) < len(lines)
    with pytest.raises(openai.ConflictError):
        oai.batches.cancel(b.id)


def test_a_batch_past_its_window_expires_with_its_finished_lines(model_dir, tmp_path):
    """Its own Redis, API (a 3 s window) and a worker that runs one request at a time, so the
    48 slow lines (43,200 one-row steps, tens of seconds) cannot finish inside the window
    however fast the machine (on the shared workers 48 lines once completed within it)."""
    server = EmbeddedRedis()
    proc, url = start_api(server.url, tmp_path, "api-window", env={"FANOUT_BATCH_WINDOW": "3"})
    worker = WorkerProc(server.url, model_dir, tmp_path, args=["--max-running", "1"])
    try:
        worker.start()
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as short:
            lines, f = slow_batch(short, n=48)
            b = short.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            assert b.expires_at - b.created_at == 3
            b = wait(short, b.id, ("expired",), timeout=60)
            assert b.expired_at >= b.expires_at
            each_line_once(short, b, lines, "batch_expired")
    finally:
        if worker.proc and worker.proc.alive():
            worker.stop(signal.SIGKILL)
        proc.stop()
        server.stop()


def test_a_batch_whose_worker_is_killed_completes_with_each_line_once(model_dir, tmp_path):
    """Its own Redis, API and workers, with a 3 s heartbeat TTL so the job resumes quickly."""
    server = EmbeddedRedis()
    api, url = start_api(server.url, tmp_path, "api-kill")
    env = {"FANOUT_HEARTBEAT_TTL": "3"}
    dead, live = WorkerProc(server.url, model_dir, tmp_path, env), WorkerProc(server.url, model_dir, tmp_path, env)
    try:
        dead.start()
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
            lines, f = slow_batch(c, n=6, max_tokens=150)
            b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            deadline = time.monotonic() + 60
            while c.batches.retrieve(b.id).request_counts.completed < 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            dead.stop(signal.SIGKILL)
            assert c.batches.retrieve(b.id).request_counts.completed < len(lines)
            live.start()
            b = wait(c, b.id, ("completed",), timeout=90)
            out = read_lines(c, b.output_file_id)
            assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
            assert b.error_file_id is None and b.request_counts.completed == len(lines)
            assert all(x["response"]["body"]["usage"]["completion_tokens"] == x_tokens
                       for x, x_tokens in ((x, 2 if x["custom_id"].startswith("quick") else 150) for x in out))
            job_id = b.id.removeprefix("batch_")
            assert httpx.get(f"{url}/v1/jobs/{job_id}").json()["attempt"] == 2
            # Resumed: the lines stored before the kill were not run again (a sample stored
            # twice would count twice; the stream of a batch's job keeps only what is running).
            r = redis_lib.Redis.from_url(server.url)
            n = str(len(lines)).encode()
            assert r.hmget(keys.info(job_id), "samples_done", "done") == [n, n]
            r.close()
    finally:
        for w in (dead, live):
            if w.proc and w.proc.alive():
                w.stop(signal.SIGKILL)
        api.stop()
        server.stop()


def test_a_key_sees_only_its_own_files_and_batches(tmp_path):
    """Its own Redis (keys switch auth on for every client of a Redis) and API; no worker: the
    batch fails its validation (no model served), which is enough to own one."""
    server = EmbeddedRedis()
    api, url = start_api(server.url, tmp_path, "api-keys")
    r = redis_lib.Redis.from_url(server.url)
    key_a, _ = tenants.create(r, "a", {})
    key_b, _ = tenants.create(r, "b", {})
    try:
        with openai.OpenAI(base_url=url + "/v1", api_key=key_a, max_retries=0) as a, \
                openai.OpenAI(base_url=url + "/v1", api_key=key_b, max_retries=0) as b, \
                openai.OpenAI(base_url=url + "/v1", api_key="fo_nope", max_retries=0) as nobody:
            f = a.files.create(file=("a.jsonl", jsonl([chat_line("x", "hi")])), purpose="batch")
            batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            assert batch.status == "failed" and batch.errors.data[0].code == "model_not_found"
            assert [x.id for x in a.files.list()] == [f.id] and [x.id for x in a.batches.list()] == [batch.id]
            assert b.files.list().data == [] and b.batches.list().data == []
            for call in (lambda: b.files.retrieve(f.id), lambda: b.files.content(f.id), lambda: b.files.delete(f.id),
                         lambda: b.batches.retrieve(batch.id), lambda: b.batches.cancel(batch.id),
                         lambda: b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h")):
                with pytest.raises(openai.NotFoundError):
                    call()
            with pytest.raises(openai.AuthenticationError) as e:
                nobody.models.list()
            assert e.value.type == "authentication_error"
    finally:
        r.close()
        api.stop()
        server.stop()


def test_a_line_with_a_lone_surrogate_is_named_at_upload(oai):
    """One bad line of three: the upload names it (before: 202, then every line failed)."""
    lines = [chat_line("a", "x"), chat_line("b", "bad \ud800"), chat_line("c", "z")]
    with pytest.raises(openai.BadRequestError) as e:
        oai.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    assert "line 2" in e.value.message and "lone surrogate" in e.value.message
    assert "line 1" not in e.value.message and "line 3" not in e.value.message


def test_a_line_nested_100000_deep_is_a_400_naming_it(oai):
    """Not a plain-text 500 (RecursionError): OpenAI's error shape, the line named."""
    deep = ('{"custom_id": "d", "method": "POST", "url": "/v1/chat/completions", "body": '
            + "[" * 100_000 + "]" * 100_000 + "}\n").encode()
    with pytest.raises(openai.BadRequestError) as e:
        oai.files.create(file=("deep.jsonl", jsonl([chat_line("a", "x")]) + deep), purpose="batch")
    assert "line 2: " in e.value.message and "nested too deeply" in e.value.message and e.value.param == "file"
    assert oai.files.create(file=("ok.jsonl", jsonl([chat_line("a", "x")])), purpose="batch").id


def test_an_api_killed_while_finalizing_is_replaced_within_its_lease(model_dir, tmp_path):
    """The API process writing a batch's files dies (kill -9) holding the finalize lease:
    another one finishes it within the lease (LEASE seconds; before: a 600 s lock), each
    custom_id once, one output file (its id is the batch's, so no orphan). Then a holder
    paused past its lease (SIGSTOP) is replaced, and once resumed writes nothing that counts."""
    from api.openai.batches import LEASE
    from results import keys

    server = EmbeddedRedis()
    r = redis_lib.Redis.from_url(server.url)
    first, url = start_api(server.url, tmp_path, "api-final-1")
    worker = WorkerProc(server.url, model_dir, tmp_path)
    procs = [first]
    n = 3000
    lines = [chat_line(f"line-{i}", f"question {i}", max_tokens=1) for i in range(n)]
    try:
        worker.start()
        for stop in (signal.SIGKILL, signal.SIGSTOP):
            holder = procs[-1]
            with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
                f = c.files.create(file=("many.jsonl", jsonl(lines)), purpose="batch")
                b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            lock = keys.batch_lock(b.id)
            deadline = time.monotonic() + 300
            while not r.exists(lock):  # the holder's sweep takes the lease once the job ends
                assert time.monotonic() < deadline, "the batch never started finalizing"
                time.sleep(0.002)
            holder.proc.send_signal(stop)
            t = time.monotonic()
            assert r.ttl(lock) <= LEASE
            other, url = start_api(server.url, tmp_path, f"api-final-{len(procs) + 1}")
            procs.append(other)
            with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
                done = wait(c, b.id, ("completed",), timeout=LEASE + 60)
                took = time.monotonic() - t
                if stop == signal.SIGSTOP:
                    holder.proc.send_signal(signal.SIGCONT)
                    time.sleep(2)  # it wakes, finds its lease gone, and stops
                    assert c.batches.retrieve(b.id).model_dump() == done.model_dump()
                out = read_lines(c, done.output_file_id)
                outputs = [x for x in c.files.list(purpose="batch_output") if x.filename.startswith(b.id)]
            assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
            assert done.request_counts.completed == n and done.error_file_id is None
            assert [x.id for x in outputs] == [done.output_file_id]
            print(f"finalize holder stopped by {stop.name}: batch completed {took:.1f}s later (lease {LEASE}s)")
    finally:
        for p in procs:
            if p.alive():
                p.proc.send_signal(signal.SIGCONT)
                p.stop()
        if worker.proc and worker.proc.alive():
            worker.stop()
        r.close()
        server.stop()
