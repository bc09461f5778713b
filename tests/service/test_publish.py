"""The worker's round trips (worker/publish.py), one engine step at a time in one process,
against a real Redis and the real tiny model.

While nobody follows a running job's stream and the engine is full, a step's writes are
carried and sent with a later step's (at most a delta interval later, or when a shard
finishes): Redis sees a transaction every few steps, not every step. The engine here
runs 3 requests at once, so the tests' 4 items fill it until the last ones end. The
invariants that hold all the same:
a shard ends only after its samples are stored; an attempt that ends otherwise (fails,
is canceled) sends its carried samples first, so the next attempt does not redo them; an
attempt reaped while its samples were carried never writes them (the next attempt stores
each sample once); a followed job is sent every step; a new job or a cancel wakes the
worker (keys.wake), and its next step sends.
"""
import contextlib
import json
import time

import pytest
import redis as redis_lib
from rq import Queue
from rq.serializers import JSONSerializer

from api import jobs
from api.schemas import JobRequest
from cli.redis_server import EmbeddedRedis
from conftest import follow_stream
from jobs import models
from jobs.settings import Settings
from jobs.spec import queues as model_queues
from results import keys
from worker import reaper
from worker.consumer import Consumer
from worker.engine import SamplingParams

PROMPTS = ["the quick brown fox", "def fibonacci(n):", "import os", "hello world"]
# Item 0 finishes long before the shard ends, and item 3, waiting, takes its place.
PARAMS = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (2, 20, 20, 20)]
INTERVAL = 3600.0  # no send falls due by time during a test: only the ones the rules force


@pytest.fixture(scope="module")
def engine(model_dir):
    """Full with the tests' 4 items (Engine.has_room false): the case where steps are carried."""
    from worker.engine import Engine
    return Engine(model_dir, device="cpu", max_running=3)


@pytest.fixture
def fleet(engine, tmp_path):
    """An in-process worker (the real Consumer) on its own Redis, with a delta interval no
    test outlives."""
    server = EmbeddedRedis()
    settings = Settings(redis_url=server.url, storage_url=f"file://{tmp_path}/blobs")
    r = redis_lib.Redis.from_url(server.url)
    w = Consumer(engine, redis_lib.Redis.from_url(server.url), settings, name="in-process", model="llama",
                 delta_interval=INTERVAL)
    models.announce_loading(r, "llama", "generate")  # its model known, as `fanout worker` does first
    try:
        yield w, r, settings
    finally:
        while engine.has_work():  # a test that stopped midway leaves the shared engine empty
            for tag in {ev.tag for ev in engine.step()}:
                engine.abort(tag)
        w.link.connection.close()
        r.close()
        server.stop()


def transactions(r) -> int:
    return r.info("commandstats").get("cmdstat_exec", {}).get("calls", 0)


def stored(r, job_id) -> dict:
    return {k.decode(): json.loads(v) for k, v in r.hgetall(keys.results(job_id)).items()}


def reference(engine) -> list[list[int]]:
    out = engine.generate(prompts=PROMPTS, sampling_params=[SamplingParams(**p) for p in PARAMS])
    return [it.samples[0].token_ids for it in out]


def submit(r, settings, follow=False) -> str:
    job_id = jobs.submit(r, JobRequest(prompts=PROMPTS, sampling_params=PARAMS), settings)["id"]
    if follow:
        follow_stream(r, job_id)
    return job_id


def step_until(w, engine, cond, limit=100) -> int:
    """Step the engine and publish until cond(); the steps it took."""
    for n in range(1, limit + 1):
        w.publisher.publish(engine.step())
        if cond():
            return n
    raise AssertionError("not reached")


def sent_every_step_to_the_end(w, r, engine, job_id) -> None:
    """Step the running job to its end: a transaction (at least) every step, and it succeeds."""
    before = transactions(r)
    steps = step_until(w, engine, lambda: not w.attempts.active)
    assert transactions(r) - before >= steps
    assert jobs.status_of(r, job_id)[0] == "succeeded"


def carrying_item_0(w, r, settings, engine):
    """(job id, its attempt) of an unfollowed job stepped until item 0 finished: its sample
    carried, nothing stored yet."""
    job_id = submit(r, settings)
    w.admission.admit(block=False)
    (a,) = w.attempts.active.values()
    step_until(w, engine, lambda: a.left[0] == 0)
    assert stored(r, job_id) == {}
    return job_id, a


def test_an_unfollowed_job_is_sent_every_few_steps_and_ends_after_its_samples(fleet, engine):
    w, r, settings = fleet
    job_id = submit(r, settings)
    w.admission.admit(block=False)
    before = transactions(r)
    steps = step_until(w, engine, lambda: not w.attempts.active)
    assert steps >= 22
    sent = transactions(r) - before
    # The first step's send (due), the last steps' (room), the settle: a few, not one a step.
    assert sent <= steps // 3, (sent, steps)
    assert jobs.status_of(r, job_id)[0] == "succeeded"
    got = stored(r, job_id)
    assert [got[f"{i}:0"]["token_ids"] for i in range(4)] == reference(engine)
    assert int(r.hget(keys.info(job_id), "samples_done")) == 4
    assert int(r.hget(keys.info(job_id), "steps")) == steps


def test_an_engine_with_room_is_sent_every_step(fleet, engine):
    """A queued shard may join it: the queues are read (and the steps' writes sent) every step."""
    w, r, settings = fleet
    job_id = jobs.submit(r, JobRequest(prompts=PROMPTS[:2], sampling_params=PARAMS[:2]), settings)["id"]
    w.admission.admit(block=False)
    w.publisher.publish(engine.step())  # its samples reach the scheduler: 2 of 3 slots
    assert w.engine.has_room()
    sent_every_step_to_the_end(w, r, engine, job_id)


def test_a_followed_job_is_sent_every_step(fleet, engine):
    w, r, settings = fleet
    job_id = submit(r, settings, follow=True)
    w.admission.admit(block=False)
    w.publisher.publish(engine.step())  # the first send reads the followed flag
    assert all(a.followed for a in w.attempts.active.values())
    step_until(w, engine, lambda: "0:0" in stored(r, job_id))  # item 0's final goes out at its step
    assert w.attempts.active  # long before the shard ends
    sent_every_step_to_the_end(w, r, engine, job_id)


def test_an_attempt_that_fails_sends_its_carried_samples_first(fleet, engine):
    w, r, settings = fleet
    job_id, a = carrying_item_0(w, r, settings, engine)
    w.attempts.fail(a, "RuntimeError: boom")
    assert list(stored(r, job_id)) == ["0:0"]  # sent before the attempt ended
    w.admission.admit(block=False)  # the retry: item 0 is not generated again
    (b,) = w.attempts.active.values()
    assert b.claim.attempt == 2 and b.claim.stored == {(0, 0)} and b.remaining == 3
    step_until(w, engine, lambda: not w.attempts.active)
    assert jobs.status_of(r, job_id)[0] == "succeeded"
    got = stored(r, job_id)
    assert [got[f"{i}:0"]["token_ids"] for i in range(4)] == reference(engine)
    assert int(r.hget(keys.info(job_id), "samples_done")) == 4


@contextlib.contextmanager
def woken(w):
    """The worker's listener on its queues' wake channels (keys.wake), as `fanout worker`
    starts it; yields a wait for the next message."""
    w.member.subscribe()
    try:
        def wait(seen):
            deadline = time.monotonic() + 10  # the listener reads the message as it arrives
            while w.member.wakes == seen:
                assert time.monotonic() < deadline, "no wake message came"
                time.sleep(0.005)
        yield wait
    finally:
        w.member.pubsub_thread.stop()
        w.member.pubsub.close()


def test_a_new_job_wakes_a_carrying_worker_at_its_next_step(fleet, engine):
    """Carried steps send nothing, so the queues are not read; a new job's submit publishes
    on the queue's wake channel and the next step sends and reads them, whatever the
    interval (here an hour)."""
    w, r, settings = fleet
    carrying_item_0(w, r, settings, engine)
    with woken(w) as wait:
        seen = w.member.wakes
        assert w.publisher.publish(engine.step()) == (False, None)  # carried: nothing read
        submit(r, settings)
        wait(seen)
        before = transactions(r)
        queued, _ = w.publisher.publish(engine.step())
    assert queued and transactions(r) == before + 1


def test_a_cancel_sends_the_carried_samples_and_stops_the_job(fleet, engine):
    """The cancel wakes the worker: its next step reads the flag, whatever the interval."""
    w, r, settings = fleet
    job_id, _ = carrying_item_0(w, r, settings, engine)
    with woken(w) as wait:
        seen = w.member.wakes
        jobs.cancel(r, job_id, settings)
        wait(seen)
        w.publisher.publish(engine.step())
    assert not w.attempts.active  # its requests aborted (their last events leave the engine next step)
    assert jobs.status_of(r, job_id)[0] == "canceled"
    assert list(stored(r, job_id)) == ["0:0"]  # the finished sample stays


def test_a_reaped_attempt_never_writes_its_carried_samples(fleet, engine):
    """Reaped while its item 0 was carried (a step outlasted its TTL, another worker's
    reaper queued the shard again): the drop discards the carried writes, and the next
    attempt stores every sample once; counted once."""
    w, r, settings = fleet
    job_id, _ = carrying_item_0(w, r, settings, engine)
    queues = [Queue(name, connection=r, serializer=JSONSerializer) for name in model_queues("llama")]
    for q in queues:
        for entry in r.zrange(q.started_job_registry.key, 0, -1):
            r.zadd(q.started_job_registry.key, {entry: 1})
    assert [o for _, _, o in reaper.reap(r, queues, JSONSerializer, 3600, lambda e: None)] == ["retried (shard 0)"]
    w.member.beat_soon()
    w.publisher.publish(engine.step())  # beats first: reaped, dropped, its carried writes with it
    assert not w.attempts.active and not w.attempts.carry.jobs
    assert stored(r, job_id) == {}
    w.admission.admit(block=False)
    (b,) = w.attempts.active.values()
    assert b.claim.attempt == 2 and b.claim.stored == set()
    step_until(w, engine, lambda: not w.attempts.active)
    assert jobs.status_of(r, job_id)[0] == "succeeded"
    got = stored(r, job_id)
    assert [got[f"{i}:0"]["token_ids"] for i in range(4)] == reference(engine)
    assert int(r.hget(keys.info(job_id), "samples_done")) == 4
