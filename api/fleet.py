"""GET /v1/fleet, the operator's view (admin keys, or anyone in open mode: api.auth.admin):
the workers, the models they serve, the shards queued per model and priority, tokens/s.

All of it is what Redis keeps already: rq's worker registry and each worker's hash (rq's
fields, and `fanout`: its model and token rates, worker/member.py), the served models
(jobs/models.py) and the queues' counts as /metrics has them (api/metrics.py, read here from
the same collector, so both always agree).
"""
from __future__ import annotations

import json
import time
from collections import Counter

import redis
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from rq import worker_registration
from rq.utils import utcparse
from rq.worker import Worker

from jobs import models
from results.events import worker_ref

from . import metrics

router = APIRouter(prefix="/v1")

FIELDS = ("state", "hostname", "pid", "birth", "last_heartbeat", "fanout")


class WorkerOut(BaseModel):
    name: str = Field(description="its rq name (`fanout worker --name`; by default host and PID)")
    ref: str = Field(description="the opaque id a job's stream and `shards.workers` show of it")
    model: str | None = Field(description="the model it serves (null before its first heartbeat)")
    state: str | None = Field(description="rq's: idle, busy, ...")
    live: bool = Field(description="its last heartbeat is within FANOUT_HEARTBEAT_TTL (else its shards "
                                   "are retried elsewhere, and its rq entry lapses in minutes)")
    hostname: str | None
    pid: int | None
    started_at: str | None
    last_heartbeat: str | None
    prefill_tokens_per_s: float = Field(description="prompt tokens its engine ran per second over its last "
                                                    "heartbeat interval (FANOUT_HEARTBEAT_TTL / 3)")
    decode_tokens_per_s: float = Field(description="tokens it generated per second over that interval")


class ModelOut(BaseModel):
    name: str
    state: str = Field(description="live (a worker serves it), loading, or away (known, no worker now)")
    task: str
    parent: str | None = Field(description="a LoRA adapter's base model")
    workers: int = Field(description="live workers serving it (a LoRA adapter's: its base's)")


class QueueOut(BaseModel):
    model: str
    priority: str
    queue: str = Field(description="rq's queue name")
    queued: int = Field(description="shards waiting in the queue")
    scheduled: int = Field(description="shards waiting for their time (run_at, a held shard)")
    running: int


class Fleet(BaseModel):
    workers: list[WorkerOut]
    models: list[ModelOut]
    queues: list[QueueOut] = Field(description="every known model's queues, by model then priority high, normal, low")
    decode_tokens_per_s: float = Field(description="the live workers' sum")


def workers(conn, heartbeat_ttl: float) -> list[dict]:
    """Every worker in rq's registry, by name, in two round trips."""
    names = sorted(k.decode().removeprefix(Worker.redis_worker_namespace_prefix)
                   for k in conn.smembers(worker_registration.REDIS_WORKER_KEYS))
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hmget(Worker.redis_worker_namespace_prefix + name, FIELDS)
        rows = pipe.execute()
    now, out = time.time(), []
    for name, row in zip(names, rows):
        state, hostname, pid, birth, beat, own = (v.decode() if v is not None else None for v in row)
        if beat is None:  # its hash lapsed before the registry was cleaned
            continue
        own = json.loads(own) if own else {}
        out.append({"name": name, "ref": worker_ref(name), "model": own.get("model"), "state": state,
                    "live": now - utcparse(beat).timestamp() <= heartbeat_ttl, "hostname": hostname,
                    "pid": int(pid) if pid else None, "started_at": birth, "last_heartbeat": beat,
                    "prefill_tokens_per_s": own.get("prefill_tokens_per_s", 0.0),
                    "decode_tokens_per_s": own.get("decode_tokens_per_s", 0.0)})
    return out


def queues(conn) -> list[dict]:
    """The fanout_shards gauge of /metrics, as rows: one per model and priority."""
    rows, up = {}, False
    for family in metrics.Jobs(conn).collect():
        for s in family.samples:
            if s.name == "fanout_api_redis_up":
                up = bool(s.value)
            elif s.name == "fanout_shards":
                row = rows.setdefault(s.labels["queue"], {"model": s.labels["model"], "priority": s.labels["priority"],
                                                          "queue": s.labels["queue"]})
                row[s.labels["status"]] = int(s.value)
    if not up:  # the collector keeps a scrape going; this answers 503 like any route without Redis
        raise redis.ConnectionError("redis unavailable while counting the queues")
    return list(rows.values())


@router.get("/fleet", response_model=Fleet)
def fleet(request: Request):
    """The workers (with their model and tokens/s), the models and every queue's shards."""
    st = request.app.state
    found = workers(st.redis, st.settings.heartbeat_ttl)
    live = [w for w in found if w["live"]]
    serving = Counter(w["model"] for w in live)
    return {"workers": found,
            "models": [{"name": m.name, "state": m.state, "task": m.task, "parent": m.parent,
                        "workers": serving[m.base]} for _, m in sorted(models.read(st.redis).items())],
            "queues": queues(st.redis),
            "decode_tokens_per_s": round(sum(w["decode_tokens_per_s"] for w in live), 1)}
