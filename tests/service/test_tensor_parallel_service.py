"""`fanout worker --tensor-parallel-size 2` on the CPU: the worker process is rank 0 and
starts rank 1; a job through the API gives the tokens one rank gives in this process, and a
rank killed (kill -9) makes the worker give its jobs back and exit, naming the rank."""
import os
import signal
import subprocess
import time

import pytest
import redis as redis_lib

from conftest import own_service, wait_for, worker_pid
from results import reader
from results.client import Client
from worker.engine import Engine, SamplingParams
from worker.engine.models.tiny import build_tiny_model

PROMPTS = ["the quick brown fox", "def fibonacci(n):", "import os", "hello world, again and again"]
NAME = "tiny-tp"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """One KV head (replicated on both ranks) and a vocab of 501 (the second rank's rows padded)."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tp") / "m"), arch="llama", num_kv_heads=1,
                            vocab_size=501)


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_a_job_on_two_ranks_equals_one_rank_and_a_dead_rank_ends_the_worker(model, tmp_path):
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    sampled = {"max_new_tokens": 8, "temperature": 0.9, "n": 3, "ignore_eos": True}
    engine = Engine(model, device="cpu")
    ref = engine.generate(prompts=PROMPTS, sampling_params=[SamplingParams(**greedy)] * 3
                          + [SamplingParams(**sampled)], seed=11)
    with own_service(model, tmp_path, NAME, args=["--tensor-parallel-size", "2"]) as (url, redis_url), \
            Client(url) as c:
        conn = redis_lib.Redis.from_url(redis_url)
        job = c.submit(prompts=PROMPTS, sampling_params=[greedy] * 3 + [sampled], seed=11, model=NAME)
        list(reader.follow(conn, job["id"], timeout=120))
        assert c.status(job["id"])["status"] == "succeeded"
        got = [[s["token_ids"] for s in it["samples"]] for it in c.results(job["id"])]
        assert got == [[s.token_ids for s in it.samples] for it in ref]

        worker = worker_pid(redis_url)
        [follower] = children(worker)
        long = c.submit(prompts=["go on"] * 16, model=NAME,
                        sampling_params={"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True})
        wait_for(lambda: c.status(long["id"])["status"] == "running", 60, "the long job to run")
        os.kill(follower, signal.SIGKILL)
        t = time.monotonic()
        wait_for(lambda: not os.path.exists(f"/proc/{worker}") or _zombie(worker), 60,
                 "the worker to exit after its rank died")
        # It fails the job's attempt, which goes back to the queue (it has retries left).
        status = c.status(long["id"])
        assert status["status"] in ("queued", "failed"), status
        assert time.monotonic() - t < 60
        conn.close()
    # The worker's start of its rank and its exit, as its log says them.
    log = open(next(tmp_path.glob("test-worker-*.log"))).read()
    assert "tensor parallel: 2 ranks" in log and "tensor-parallel rank 1" in log


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
