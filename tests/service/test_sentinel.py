"""Redis Sentinel: a primary, a replica and three sentinels (real server processes on local
ports); the API and a worker name them by REDIS_URL=redis+sentinel://.... The primary is
killed (kill -9) mid-job, and again while an API process writes a batch's files: once the
sentinels have promoted the replica, the job completes, each sample final once in its
stream and equal to the engine's, the batch completes with each line once, and the API
answers again. The stalls are printed."""
import json
import os
import signal
import subprocess
import tempfile
import time
from collections import Counter

import httpx
import openai
import redis as redis_lib

from conftest import WorkerProc, follow_stream, start_api, wait_for
from cli.redis_server import free_port, redis_binary
from jobs.redis_url import connect
from results import keys, reader
from results.client import Client
from worker.engine import SamplingParams

SERVICE = "fanout"
PROMPTS = [f"Item {i} says" for i in range(8)]
SP = {"max_new_tokens": 600, "temperature": 0.8, "ignore_eos": True}


class Group:
    """A primary, its replica and three sentinels that watch it (quorum 2, down after 1 s)."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="fanout-sentinel-")
        self.procs: dict[str, subprocess.Popen] = {}
        self.primary, self.replica = free_port(), free_port()
        self._server("primary", self.primary)
        self._server("replica", self.replica, "--replicaof", "127.0.0.1", str(self.primary))
        self.sentinels = [free_port() for _ in range(3)]
        for i, port in enumerate(self.sentinels):
            conf = os.path.join(self.dir, f"sentinel{i}.conf")
            with open(conf, "w") as f:  # sentinels rewrite their file: one each
                f.write(f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                        f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary} 2\n"
                        f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                        f"sentinel failover-timeout {SERVICE} 5000\n")
            self._start(f"sentinel{i}", [redis_binary(), conf, "--sentinel"])
        self.url = f"redis+sentinel://{','.join(f'127.0.0.1:{p}' for p in self.sentinels)}/{SERVICE}"
        wait_for(self._watched, 30, "the sentinels to see the primary and its replica")

    def _server(self, name: str, port: int, *args: str) -> None:
        self._start(name, [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                           "--appendonly", "no", "--dir", self.dir, *args])

    def _start(self, name: str, argv: list[str]) -> None:
        self.procs[name] = subprocess.Popen(argv + ["--logfile", os.path.join(self.dir, f"{name}.log")],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _watched(self) -> bool:
        try:
            for port in self.sentinels:
                s = redis_lib.Redis(port=port, decode_responses=True)
                master = s.sentinel_master(SERVICE)
                if master["num-slaves"] < 1 or master["num-other-sentinels"] < 2:
                    return False
            return redis_lib.Redis(port=self.replica).info("replication")["master_link_status"] == "up"
        except (redis_lib.RedisError, KeyError):
            return False

    def promoted(self) -> bool:
        """Every sentinel names the replica as the primary."""
        try:
            return all(redis_lib.Redis(port=p).sentinel_get_master_addr_by_name(SERVICE)[1] == self.replica
                       for p in self.sentinels)
        except (redis_lib.RedisError, TypeError):
            return False

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_sharded_job_completes_after_the_primary_is_killed(model_dir, engine, tmp_path):
    group = Group()
    env = {"FANOUT_SHARD_SAMPLES": "2"}  # 4 shards
    api = worker = None
    try:
        api, url = start_api(group.url, tmp_path, "api", env=env)
        worker = WorkerProc(group.url, model_dir, tmp_path, env=env, args=["--max-running", "2"])  # a shard at a time
        worker.start()
        r = connect(group.url)
        client = Client(url)
        job = client.submit(prompts=PROMPTS, sampling_params=SP, seed=3)["id"]
        follow_stream(r, job)
        wait_for(lambda: any(e[b"type"] == b"delta" for _, e in r.xrange(keys.stream(job))), 120,
                 "the first tokens")

        group.procs["primary"].send_signal(signal.SIGKILL)
        killed = time.time()
        wait_for(group.promoted, 60, "the replica promoted")
        promoted = time.time()
        r = connect(group.url)  # the test's own reads, from the new primary
        follow = list(reader.follow(r, job, timeout=120))
        assert follow[-1][1]["status"] == "succeeded", follow[-1]
        after = [int(i.split("-")[0]) / 1000 for i, _ in follow if int(i.split("-")[0]) / 1000 > killed]
        assert after, "the job ended before the kill"  # the worker wrote on after the failover
        stall = min(after) - killed

        es = [reader.events.decode(f) for _, f in r.xrange(keys.stream(job))]
        finals = Counter((e["index"], e["sample"]) for e in es if e["type"] == "final")
        assert len(finals) == len(PROMPTS) and set(finals.values()) == {1}, finals
        got = {it["index"]: it["samples"][0]["token_ids"] for it in client.results(job)}
        ref = engine.generate(prompts=PROMPTS, sampling_params=SamplingParams(**SP), seed=3)
        assert got == {it.index: it.samples[0].token_ids for it in ref}
        with httpx.Client(base_url=url, timeout=10) as http:
            assert http.get("/healthz").status_code == 200
            assert http.get(f"/v1/jobs/{job}").json()["status"] == "succeeded"
        assert worker.proc.alive(), worker.proc.tail()
        print(f"\nsentinel failover: replica promoted {promoted - killed:.1f} s after the kill; the worker "
              f"wrote again {stall:.1f} s after it")
        client.close()
    finally:
        for p in (worker, api):
            if p is not None:
                p.stop()
        group.stop()


def test_a_batch_finalizing_when_the_primary_is_killed_completes(model_dir, tmp_path):
    """An OpenAI batch of 3,000 lines; the primary is killed (kill -9) while an API process
    writes the batch's files (holding its finalize lease). Once the replica is promoted, the
    batch completes: each custom_id once, one output file, no error file. The stall (the
    kill to `completed`) is printed."""
    n = 3000
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "llama", "messages": [{"role": "user", "content": f"question {i}"}],
                       "max_tokens": 1}} for i in range(n)]
    group = Group()
    api = worker = None
    try:
        api, url = start_api(group.url, tmp_path, "api")
        worker = WorkerProc(group.url, model_dir, tmp_path)
        worker.start()
        r = connect(group.url)
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30) as c:
            f = c.files.create(file=("many.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                               purpose="batch")
            b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            wait_for(lambda: r.exists(keys.batch_lock(b.id)), 300, "the batch to start finalizing", interval=0.002)
            group.procs["primary"].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            wait_for(group.promoted, 60, "the replica promoted")
            promoted = time.monotonic()

            def completed():
                try:
                    return c.batches.retrieve(b.id).status == "completed"
                except (openai.APIStatusError, openai.APIConnectionError) as e:  # a 503 while it fails over
                    assert getattr(e, "status_code", 503) == 503, e
                    return False
            wait_for(completed, 120, "the batch to complete", interval=0.1)
            took = time.monotonic() - killed
            done = c.batches.retrieve(b.id)
            out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
            outputs = [x.id for x in c.files.list(purpose="batch_output") if x.filename.startswith(b.id)]
        assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
        assert all(x["response"]["status_code"] == 200 for x in out)
        assert done.request_counts.completed == n and done.request_counts.failed == 0
        assert done.error_file_id is None and outputs == [done.output_file_id]
        assert worker.proc.alive(), worker.proc.tail()
        print(f"\nsentinel failover while finalizing: replica promoted {promoted - killed:.1f} s after the "
              f"kill; the batch completed {took:.1f} s after it")
    finally:
        for p in (worker, api):
            if p is not None:
                p.stop()
        group.stop()
