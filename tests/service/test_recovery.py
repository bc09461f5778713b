"""A worker killed with SIGKILL mid-job: its jobs are retried on a live worker (resuming from
the stored samples), failed (no retries left) or canceled (a cancel was asked) within the
heartbeat TTL plus a few seconds, and every stream gets its terminal entry. Its own Redis,
API and workers; the killed worker runs with the default TTL (30 s)."""
import json
import signal
import time
from collections import Counter

import pytest
import redis as redis_lib
from rq.job import Job

from api import jobs
from api.schemas import JobRequest
from conftest import WorkerProc, entries, follow_stream, start_api, wait_for
from results import keys, reader
from results.client import Client
from cli.redis_server import EmbeddedRedis
from worker.engine import SamplingParams
from jobs.settings import Settings

TARGET_S = 45  # from the kill to the job succeeded (default TTL 30 s + reaping + the rest of the job)
LIVE_TTL = 4  # the live workers' own TTL, which their jobs outlive
SHORT = {"max_new_tokens": 4, "n": 2, "temperature": 0.8, "ignore_eos": True}
LONG = {"max_new_tokens": 60, "temperature": 0.8, "ignore_eos": True}
PROMPTS = [f"item {i}: the quick brown fox" for i in range(24)]
PARAMS = [SHORT] * 16 + [LONG] * 8  # the short items finish before the kill, the long ones after


@pytest.fixture(scope="module")
def service(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("recovery")
    server = EmbeddedRedis()
    api, url = start_api(server.url, logs, "api")
    r = redis_lib.Redis.from_url(server.url)
    live = [WorkerProc(server.url, model_dir, logs, env={"FANOUT_HEARTBEAT_TTL": str(LIVE_TTL)}) for _ in range(2)]
    yield {"url": server.url, "redis": r, "api": url, "logs": logs, "live": live}
    for w in live:
        if w.proc:
            w.stop()
    api.stop()
    r.close()
    server.stop()


def terminal(r, job_id):
    """The terminal entries, each with the time it was written (from its stream id)."""
    return [(int(i.split(b"-")[0]) / 1000, e) for i, e in
            ((i, reader.events.decode(f)) for i, f in r.xrange(keys.stream(job_id))) if reader.events.is_terminal(e)]


def at(r, job_id, k):
    """When the job's k-th stream entry was written."""
    return int(r.xrange(keys.stream(job_id))[k][0].split(b"-")[0]) / 1000


def test_a_killed_workers_jobs_resume_fail_or_cancel_within_the_ttl(service, model_dir, engine):
    r, api = service["redis"], service["api"]
    dead = WorkerProc(service["url"], model_dir, service["logs"])  # default TTL
    try:
        dead.start()
        with Client(api) as client:
            check_the_jobs(r, client, dead, service["live"], engine)
    finally:
        if dead.proc and dead.proc.alive():
            dead.stop(signal.SIGKILL)


def check_the_jobs(r, client, dead, live, engine):
    resumed = client.submit(prompts=PROMPTS, sampling_params=PARAMS, seed=5)["id"]
    canceled = client.submit(prompts=["cancel me"], sampling_params={**LONG, "max_new_tokens": 900})["id"]
    no_retry = Settings(result_ttl=3600, job_retries=0)  # a job submitted where FANOUT_JOB_RETRIES=0
    failed = jobs.submit(r, JobRequest(prompts=["fail me"], sampling_params={**LONG, "max_new_tokens": 900}),
                         no_retry)["id"]

    # Kill it once all three run on it and some samples of the first are stored (cheap checks:
    # the long items have ~50 engine steps to go).
    def mid_job():
        return r.hlen(keys.results(resumed)) >= 4 and all(r.hget(keys.info(j), "attempt") for j in
                                                           (resumed, canceled, failed))
    wait_for(mid_job, 60, "the jobs to run on the first worker", interval=0.002)
    dead.stop(signal.SIGKILL)
    killed_at = time.time()
    stored_before = r.hlen(keys.results(resumed))
    assert 0 < stored_before < 16 * 2 + 8, "the kill must land mid-job"
    assert client.cancel(canceled)["status"] == "running"  # orphaned: no worker watches its flag

    for w in live:
        w.start()
    info = wait_for(lambda: (i := client.status(resumed))["status"] in ("succeeded", "failed") and i,
                    TARGET_S + 15, "the job to resume and finish", interval=0.2)
    done_in = time.time() - killed_at
    assert info["status"] == "succeeded" and info["attempt"] == 2, info
    assert done_in < TARGET_S, f"succeeded {done_in:.1f}s after the kill"
    assert info["progress"] == {"total": 24, "done": 24, "failed": 0, "samples": 40, "samples_done": 40}
    assert info["usage"]["completion_tokens"] == 16 * 2 * 4 + 8 * 60  # nothing counted twice

    # The stream: attempt 1, the reaper's retry entry, attempt 2 only for what was not stored.
    es = entries(r, resumed)
    attempts = [k for k, e in enumerate(es) if e["type"] == "attempt"]
    assert len(attempts) == 2
    first, second = es[:attempts[1]], es[attempts[1]:]
    retry = es[attempts[1] - 1]
    assert retry["status"] == "queued" and "stopped sending heartbeats" in retry["error"], retry
    # The worker as its readers know it (opaque), never its name (host, PID).
    assert f"its worker {dead.ref} " in retry["error"] and dead.name not in retry["error"], retry
    finals = Counter((e["index"], e["sample"]) for e in es if e["type"] == "final")
    assert set(finals.values()) == {1} and len(finals) == 40  # every sample final exactly once
    before = {(e["index"], e["sample"]) for e in first if e["type"] == "final"}
    assert len(before) == stored_before
    redone = {(e["index"], e["sample"]) for e in second if e["type"] in ("delta", "final")}
    assert redone == set(finals) - before  # stored samples were not recomputed
    resumed_in = at(r, resumed, attempts[1]) - killed_at
    assert resumed_in < 30 + 5, f"attempt 2 started {resumed_in:.1f}s after the kill"

    items = client.results(resumed)
    got = {(it["index"], s["sample"]): s["token_ids"] for it in items for s in it["samples"]}
    ref = engine.generate(prompts=PROMPTS, sampling_params=[SamplingParams(**p) for p in PARAMS], seed=5)
    assert got == {(it.index, j): s.token_ids for it in ref for j, s in enumerate(it.samples)}
    rb = reader.Rebuilder()
    for e in es:
        rb.apply(e)
    assert {k: o.token_ids for k, o in rb.outputs.items()} == got and rb.status == "succeeded"

    # The orphaned job's cancel took effect when it was reaped.
    info = wait_for(lambda: (i := client.status(canceled))["status"] != "running" and i, 10, "the cancel")
    assert info["status"] == "canceled", info
    [(when, end)] = terminal(r, canceled)
    assert end["status"] == "canceled" and when - killed_at < 30 + 5, (end, when - killed_at)
    assert not Job.exists(canceled + "-0", connection=r)  # rq forgot its shard

    # No retries left: failed, with its one terminal entry; a follower of the stream returns.
    follow = list(reader.follow(r, failed, timeout=10))
    assert follow[-1][1]["status"] == "failed" and "stopped sending heartbeats" in follow[-1][1]["error"]
    [(when, end)] = terminal(r, failed)
    assert end["status"] == "failed" and when - killed_at < 30 + 5, (end, when - killed_at)
    info = client.status(failed)
    assert info["status"] == "failed" and "stopped sending heartbeats" in info["error"]
    assert dead.name not in info["error"] and dead.ref in info["error"]
    assert "attempts that stored nothing" in info["error"], info  # FANOUT_JOB_RETRIES=0: the first
    assert not Job.exists(failed + "-0", connection=r)
    for k in (keys.info(failed), keys.stream(failed), keys.shards(failed)):
        assert 3000 < r.ttl(k) <= 3600, k  # result_ttl from its end, not job_timeout + result_ttl
    assert dead.proc.proc.returncode == -signal.SIGKILL


def test_a_live_workers_jobs_are_never_reaped(service):
    """Two live workers with a 4 s TTL, each reaping every 2 s: a job running for more than
    two TTLs keeps its first attempt, as its worker heartbeats it between engine steps."""
    r, live = service["redis"], service["live"]
    for w in live:
        if not (w.proc and w.proc.alive()):
            w.start()
    with Client(service["api"]) as client:
        # 192 samples of 1000 tokens: about three KV pools' worth, so the job outlives the wait
        # below on any machine (64 samples once finished within it on a quiet one).
        job = client.submit(prompts=PROMPTS, sampling_params={**LONG, "max_new_tokens": 1000, "n": 8})["id"]
        it = reader.follow(r, job, timeout=60)
        next(e for _, e in it if e["type"] == "delta")
        time.sleep(2 * LIVE_TTL + 1)
        info = client.status(job)
        assert info["status"] == "running" and info["attempt"] == 1, info  # still its first attempt
        client.cancel(job)
        es = [e for _, e in it]
    assert es[-1]["status"] == "canceled"
    assert not [e for e in entries(r, job) if e["type"] == "attempt" and e["attempt"] > 1]
    assert not [e for e in entries(r, job) if e.get("status") == "queued" and e.get("error")], "reaped"


def test_killed_three_times_the_job_finishes_exactly_once(service, model_dir, engine):
    """kill -9 of three workers in turn, each mid-job, with the default retries (2): every
    attempt stored samples, so none is a strike and the job succeeds; every sample is final
    exactly once, nothing stored is recomputed, and the outputs equal an uninterrupted run;
    each attempt starts within the TTL (4 s here) plus a few seconds of its kill."""
    r = service["redis"]
    for w in service["live"]:  # only the workers this test starts and kills
        if w.proc and w.proc.alive():
            w.stop()
    params = [{**LONG, "max_new_tokens": 4 + 6 * i} for i in range(32)]  # items end one by one
    prompts = [f"line {i}: a job that dies three times" for i in range(32)]
    job = jobs.submit(r, JobRequest(prompts=prompts, sampling_params=params, seed=11),
                      Settings(result_ttl=3600))["id"]
    assert Settings().job_retries == 2
    ttl = {"FANOUT_HEARTBEAT_TTL": str(LIVE_TTL)}
    kills = []
    for k, stored in enumerate((6, 14, 22)):
        w = WorkerProc(service["url"], model_dir, service["logs"], env=ttl)
        w.start()
        try:
            wait_for(lambda: r.hlen(keys.results(job)) >= stored, 90, f"{stored} samples stored", interval=0.01)
        finally:  # killed whatever happens: a worker left running would take the next test's job
            w.stop(signal.SIGKILL)
        kills.append((time.time(), r.hlen(keys.results(job))))
        assert kills[-1][1] < 32, f"the kill must land mid-job: {kills}"
    last = WorkerProc(service["url"], model_dir, service["logs"], env=ttl)
    last.start()
    try:
        follow = list(reader.follow(r, job, timeout=90))
    finally:
        last.stop()
    assert follow[-1][1]["status"] == "succeeded"
    # Its status carries no error: the reaped attempts' are in the stream's status entries.
    assert Client(service["api"]).status(job)["error"] is None
    es = entries(r, job)
    attempts = [k for k, e in enumerate(es) if e["type"] == "attempt"]
    assert len(attempts) == 4
    finals = Counter((e["index"], e["sample"]) for e in es if e["type"] == "final")
    assert len(finals) == 32 and set(finals.values()) == {1}
    # Each attempt regenerates only what was not stored when its predecessor died.
    for a, (killed_at, stored) in zip(attempts[1:], kills):
        done_before = {(e["index"], e["sample"]) for e in es[:a] if e["type"] == "final"}
        assert len(done_before) == stored
        assert at(r, job, a) - killed_at < LIVE_TTL + 10, "an attempt started late"
    redone = [(e["index"], e["sample"]) for e in es[attempts[1]:] if e["type"] == "final"]
    assert len(redone) == len(set(redone))
    ref = engine.generate(prompts=prompts, sampling_params=[SamplingParams(**p) for p in params], seed=11)
    got = {(it["index"], s["sample"]): s["token_ids"]
           for it in Client(service["api"]).results(job) for s in it["samples"]}
    assert got == {(it.index, j): s.token_ids for it in ref for j, s in enumerate(it.samples)}


def test_a_job_that_kills_its_worker_every_time_fails_as_poison(service, model_dir):
    """Each attempt dies before it stores anything (as a job that crashes its worker would):
    each is a strike, and after FANOUT_JOB_RETRIES + 1 of them (3 by default) the job fails,
    naming why, instead of taking worker after worker down."""
    r = service["redis"]
    for w in service["live"]:
        if w.proc and w.proc.alive():
            w.stop()
    job = jobs.submit(r, JobRequest(prompts=["a prompt that never gets far"],
                                    sampling_params={**LONG, "max_new_tokens": 900}),
                      Settings(result_ttl=3600))["id"]
    ttl = {"FANOUT_HEARTBEAT_TTL": str(LIVE_TTL)}
    for k in range(3):
        w = WorkerProc(service["url"], model_dir, service["logs"], env=ttl)
        w.start()
        wait_for(lambda: sum(e["type"] == "attempt" for e in entries(r, job)) == k + 1, 60,
                 f"attempt {k + 1} to start", interval=0.01)
        w.stop(signal.SIGKILL)
        assert r.hlen(keys.results(job)) == 0
    reaper = WorkerProc(service["url"], model_dir, service["logs"], env=ttl)  # reaps the third
    reaper.start()
    try:
        follow = list(reader.follow(r, job, timeout=60))
    finally:
        reaper.stop()
    end = follow[-1][1]
    assert end["status"] == "failed", end
    assert "stopped sending heartbeats" in end["error"] and "failed 3 attempts that stored nothing" in end["error"]
    assert sum(e["type"] == "attempt" for _, e in follow) == 3  # no fourth attempt


def test_a_shard_reaped_from_a_live_worker_and_taken_again_by_it_counts_no_aborted_sample(model_dir, tmp_path):
    """A worker whose shard was reaped (it looked dead: a step that outlasted its TTL)
    drops that attempt, aborting its requests, and, alone, claims the shard again at once.
    The aborted requests' last events are still on their way out of its engine: they
    belong to the dropped attempt, and none may count as a finished sample of the new one.
    The worker is stopped (SIGSTOP: most likely mid-step) while its shard is reaped, three
    times. (This guards the path; it did not make the code before per-attempt tags fail:
    the race the million-row benchmark met needs the drop to come in the publish after a
    long step and the shard to be claimed back before the next step: the next test replays
    that interleaving step by step, and fails on the code before.)"""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from worker import reaper
    from jobs.spec import queues as model_queues

    server = EmbeddedRedis()
    r = redis_lib.Redis.from_url(server.url)
    w = WorkerProc(server.url, model_dir, tmp_path, env={"FANOUT_HEARTBEAT_TTL": str(LIVE_TTL)})
    queues = [Queue(name, connection=r, serializer=JSONSerializer) for name in model_queues("llama")]
    try:
        w.start()
        for round_ in range(3):
            params = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
            job_id = jobs.submit(r, JobRequest(prompts=PROMPTS[:4], sampling_params=params), Settings())["id"]
            follow_stream(r, job_id)
            wait_for(lambda: any(e["type"] == "delta" for e in entries(r, job_id)), 60, "its samples to stream")
            w.proc.proc.send_signal(signal.SIGSTOP)
            try:  # the reap another worker would do, its execution made to look expired
                for q in queues:
                    for entry in r.zrange(q.started_job_registry.key, 0, -1):
                        r.zadd(q.started_job_registry.key, {entry: 1})
                assert [o for _, _, o in reaper.reap(r, queues, JSONSerializer, 3600, lambda e: None)] == \
                    ["retried (shard 0)"]
            finally:
                w.proc.proc.send_signal(signal.SIGCONT)
            wait_for(lambda: jobs.status_of(r, job_id)[0] == "succeeded", 120, "the job")
            assert max(e["attempt"] for e in entries(r, job_id) if e["type"] == "attempt") == 2
            stored = [json.loads(v) for v in r.hvals(keys.results(job_id))]
            assert len(stored) == 4 and {(s["finish_reason"], len(s["token_ids"])) for s in stored} == \
                {("length", 200)}, (round_, [(s["finish_reason"], len(s["token_ids"])) for s in stored])
    finally:
        w.stop(signal.SIGKILL)
        r.close()
        server.stop()


def test_the_aborted_events_of_a_dropped_attempt_never_count_for_the_next_one(model_dir, engine, tmp_path):
    """The million-row benchmark's race, step by step in one process: a worker's step
    outlasts its TTL, its shard is reaped and queued again meanwhile; the publish after
    that step finds it reaped and drops the attempt (its requests aborted: their final
    `abort` events wait in the engine's outbox), the queue is not empty, so the worker
    claims the same shard again before its next step. That step hands out the dropped
    attempt's abort events beside the new attempt's: each is told apart by its attempt's
    tag, and the job ends with every sample whole (before per-attempt tags, those aborts
    were stored as the new attempt's samples)."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from worker import reaper
    from jobs import models
    from jobs.spec import queues as model_queues
    from worker.consumer import Consumer

    server = EmbeddedRedis()
    settings = Settings(redis_url=server.url, storage_url=f"file://{tmp_path}/blobs")
    r = redis_lib.Redis.from_url(server.url)
    w = Consumer(engine, redis_lib.Redis.from_url(server.url), settings, name="in-process", model="llama")
    models.announce_loading(r, "llama", "generate")  # its model known, as `fanout worker` does first
    queues = [Queue(name, connection=r, serializer=JSONSerializer) for name in model_queues("llama")]
    try:
        params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
        job_id = jobs.submit(r, JobRequest(prompts=PROMPTS[:4], sampling_params=params), settings)["id"]
        w.admission.admit(block=False)
        assert [a.tag for a in w.attempts.active.values()] == [f"{job_id}-0#1"]
        for _ in range(3):
            w.publisher.publish(engine.step())
        # A long step: meanwhile another worker's reaper finds the execution expired.
        events = engine.step()
        for q in queues:
            for entry in r.zrange(q.started_job_registry.key, 0, -1):
                r.zadd(q.started_job_registry.key, {entry: 1})
        assert [o for _, _, o in reaper.reap(r, queues, JSONSerializer, 3600, lambda e: None)] == ["retried (shard 0)"]
        w.member.beat_soon()  # the step outlasted the heartbeat interval: the publish beats first
        queued, _ = w.publisher.publish(events)
        assert not w.attempts.active and queued  # dropped; its shard is queued again
        w.admission.admit(block=False)  # taken again before the next step, as the run loop does
        assert [a.tag for a in w.attempts.active.values()] == [f"{job_id}-0#2"]
        tags = set()
        while engine.has_work():
            events = engine.step()
            tags |= {ev.tag for ev in events}
            w.publisher.publish(events)
        assert tags == {f"{job_id}-0#1", f"{job_id}-0#2"}  # the dropped attempt's aborts came out here
        assert jobs.status_of(r, job_id)[0] == "succeeded"
        stored = {k.decode(): json.loads(v) for k, v in r.hgetall(keys.results(job_id)).items()}
        assert sorted(stored) == ["0:0", "1:0", "2:0", "3:0"]
        assert {(s["finish_reason"], len(s["token_ids"])) for s in stored.values()} == {("length", 24)}
        ref = engine.generate(prompts=PROMPTS[:4], sampling_params=SamplingParams(**params))
        assert [stored[f"{i}:0"]["token_ids"] for i in range(4)] == [it.samples[0].token_ids for it in ref]
    finally:
        w.link.connection.close()
        r.close()
        server.stop()


def test_the_worker_and_rqs_scheduler_send_each_command_once(engine, tmp_path):
    """redis-py retries a failed command by default (its pool keeps a Retry): the worker's
    connection must not, or a transaction whose reply was lost is sent twice, and neither
    may the connection rq's scheduler makes from its settings (a due shard queued twice)."""
    from worker.consumer import Consumer

    server = EmbeddedRedis()
    try:
        conn = redis_lib.Redis(port=server.port)  # as a library user would make one
        assert conn.get_retry().get_retries() > 0
        w = Consumer(engine, conn, Settings(redis_url=server.url, storage_url=f"file://{tmp_path}/blobs"),
                     name="once")
        assert w.link.connection.get_retry().get_retries() == 0
        assert w.member.delayed.connection.get_retry().get_retries() == 0
        w.link.connection.close()
    finally:
        server.stop()


def test_the_workers_command_listener_stops_within_its_read(engine, tmp_path):
    """rq's listener thread (worker commands over pub/sub) is stopped at shutdown, and
    redis-py 8 waits for it: when the unsubscribe's reply is read before the stop (the
    loop descheduled a moment, as under load), the stop waits for the listener's next
    read to end: rq's 60 s made a SIGTERM'd worker outlive the tests' 30 s (then kill -9)."""
    from worker.consumer import Consumer
    from worker.member import LISTEN_S

    server = EmbeddedRedis()
    try:
        w = Consumer(engine, redis_lib.Redis.from_url(server.url),
                     Settings(redis_url=server.url, storage_url=f"file://{tmp_path}/blobs"), name="listener")
        w.member.subscribe()
        time.sleep(0.2)
        w.member.pubsub.unsubscribe()
        time.sleep(0.1)  # the reply read first, the listener back in its read
        t = time.monotonic()
        w.member.pubsub_thread.stop()
        assert time.monotonic() - t < LISTEN_S + 2, f"the listener stopped {time.monotonic() - t:.1f} s later"
        w.member.pubsub.close()
        w.link.connection.close()
    finally:
        server.stop()
