"""The `fanout` CLI, recurring jobs, and the deployment files (checked by parsing)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from api import batchfile, cron
from worker.settings import Settings
from results import reader
from results.client import Client
from worker.cli import free_port, main
from worker.engine import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_lines(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_batch_file_errors_name_the_line(tmp_path):
    assert batchfile.read(write_lines(tmp_path / "ok.jsonl", ["a", {"prompt": "b", "sampling_params": {"n": 2}}])) \
        == ("prompts", ["a", "b"], [None, {"n": 2}])
    with pytest.raises(batchfile.BatchFileError, match=r"bad.jsonl:2: every line must use the same field"):
        batchfile.read(write_lines(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"input_ids": [1]}]))
    with pytest.raises(batchfile.BatchFileError, match=r"two.jsonl:1: give exactly one"):
        batchfile.read(write_lines(tmp_path / "two.jsonl", [{"prompt": "a", "messages": []}]))


def test_generate_offline_matches_the_engine(tmp_path, model_dir, engine, capsys):
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": p} for p in ["Hello", "def f(x):", "a b c"]])
    out = tmp_path / "out.jsonl"
    main(["generate", src, str(out), "--model", model_dir, "--device", "cpu", "--max-new-tokens", "6",
          "--n", "2", "--temperature", "0.9", "--seed", "3"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    want = engine.generate(prompts=["Hello", "def f(x):", "a b c"],
                           sampling_params=SamplingParams(max_new_tokens=6, n=2, temperature=0.9, seed=3))
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert [[s["token_ids"] for s in r["samples"]] for r in rows] == \
        [[s.token_ids for s in it.samples] for it in want]
    err = capsys.readouterr().err
    assert "tok/s" in err and "3/3" in err  # the progress bar: items done and throughput


def test_submit_status_results(tmp_path, api_url, worker, capsys):
    src = write_lines(tmp_path / "job.jsonl", [{"prompt": "one"}, {"prompt": "two", "sampling_params": {"n": 2}}])
    main(["submit", src, "--url", api_url, "--max-new-tokens", "4", "--stream"])
    streamed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted((x["index"], x["sample"]) for x in streamed) == [(0, 0), (1, 0), (1, 1)]
    out = tmp_path / "results.jsonl"
    main(["submit", src, "--url", api_url, "--max-new-tokens", "4", "--out", str(out)])
    job_id = re.search(r"job (\w+)", capsys.readouterr().err).group(1)
    items = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(it["samples"]) for it in items] == [1, 2]
    main(["status", job_id, "--url", api_url])
    assert json.loads(capsys.readouterr().out)["status"] == "succeeded"
    main(["results", job_id, "--url", api_url])
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == items


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


def test_compose_and_dockerfile():
    with open(os.path.join(ROOT, "compose.yaml")) as f:
        compose = yaml.safe_load(f)
    services = compose["services"]
    assert {"redis", "api", "worker"} <= set(services)
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert services["worker"]["command"][:2] == ["fanout", "worker"]
    assert services["api"]["command"][:2] == ["fanout", "api"]
    for name in ("api", "worker"):
        assert services[name]["environment"]["REDIS_URL"].startswith("redis://redis:")
        assert services[name].get("build") == "."
    assert int(services["worker"]["stop_grace_period"].rstrip("s")) > 30  # > the drain timeout

    with open(os.path.join(ROOT, "Dockerfile")) as f:
        lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    assert lines[0].startswith("FROM python:3.1")
    for ln in lines:
        if ln.startswith("COPY"):
            for src in ln.split()[1:-1]:
                assert os.path.exists(os.path.join(ROOT, src)), src
    assert any(ln.startswith("RUN pip install .") for ln in lines)
    assert json.loads(lines[-1].removeprefix("CMD "))[:2] == ["fanout", "api"]


def test_fanout_up_runs_everything_and_stops_cleanly(tmp_path):
    """No REDIS_URL and no model: an embedded Redis and the random-weight demo model."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=ROOT)
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen([sys.executable, "-m", "worker.cli", "up", "--port", str(port), "--device", "cpu"],
                          env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        with Client(f"http://127.0.0.1:{port}") as c:
            deadline = time.monotonic() + 90
            while True:  # the job waits in the queue until the worker is up
                try:
                    job = c.submit(prompts=["hi"], sampling_params={"max_new_tokens": 3})
                    break
                except Exception:
                    assert up.poll() is None and time.monotonic() < deadline, (tmp_path / "up.log").read_text()
                    time.sleep(0.2)
            assert [e["status"] for _, e in c.events(job["id"], timeout=90) if e["type"] == "status"][-1] \
                == "succeeded"
    finally:
        up.send_signal(signal.SIGINT)  # what Ctrl-C does
        code = up.wait(60)
        log.close()
    text = (tmp_path / "up.log").read_text()
    assert code == 0, text
    assert "RANDOM-WEIGHT demo model" in text and "meaningless" in text
    assert "Traceback" not in text, text[text.find("Traceback") - 300:][:4000]
