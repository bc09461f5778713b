"""The API's Prometheus metrics at /metrics: requests by route template (never a raw path:
no job ids in labels) and status, their latency, the event streams open, and the jobs in Redis
by queue and status (and how long each queue's head has waited), counted at each scrape.

Under `fanout api --workers N` the uvicorn processes share a port, so a scrape reaches any
one of them: each counts its requests in files under PROMETHEUS_MULTIPROC_DIR
(prometheus-client's multiprocess mode, which `fanout api` sets up) and answers with the
sum over all of them.
"""
from __future__ import annotations

import os
import time

import redis
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from rq import Queue
from rq.utils import utcparse
from starlette.routing import compile_path

from jobs import logs
from jobs import models as fleet
from jobs.spec import PRIORITIES, queue_name

REQUESTS = Counter("fanout_api_requests", "HTTP requests by method, route template and status code",
                   ["method", "route", "status"])
LATENCY = Histogram("fanout_api_request_duration_seconds",
                    "Seconds from a request to its response headers (an event stream's whole life "
                    "would swamp the rest), by method and route template", ["method", "route"])
# livesum: under several processes, the sum of the live ones' values.
STREAMS = Gauge("fanout_api_streams_open", "Event streams (text/event-stream responses: a job's events, a "
                "streamed completion, chat or message) this API is sending, by route template",
                ["route"], multiprocess_mode="livesum")
METHODS = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}


class RequestMetrics:
    """ASGI middleware, outermost: it also sees the answers given before routing (a body
    over the limit). It sets the log context's job id for the access line."""

    def __init__(self, app, openapi):
        self.app, self.openapi = app, openapi
        self.paths = None  # the schema's path templates, compiled on first need

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status, took = 500, None  # no response started: the server error handler answers 500
        stream = None  # the route of an event stream, counted open from its start to its end

        async def send_metered(message):
            nonlocal status, took, stream
            if message["type"] == "http.response.start":
                status, took = message["status"], time.perf_counter() - start
                logs.job_id.set(_job_id(scope, message))
                if dict(message.get("headers", ())).get(b"content-type", b"").startswith(b"text/event-stream"):
                    stream = self._route(scope)
                    STREAMS.labels(stream).inc()
            await send(message)

        try:
            await self.app(scope, receive, send_metered)
        finally:
            # Label values come from bounded sets only: templates, known methods.
            method = scope["method"] if scope["method"] in METHODS else "other"
            route = self._route(scope)
            REQUESTS.labels(method, route, str(status)).inc()
            LATENCY.labels(method, route).observe(took if took is not None else time.perf_counter() - start)
            if stream is not None:
                STREAMS.labels(stream).dec()

    def _route(self, scope) -> str:
        route = getattr(scope.get("route"), "path", None)
        if route is None:  # not routed (a body over the limit, an unknown path): match the schema
            if self.paths is None:
                self.paths = [(compile_path(p)[0], p) for p in self.openapi()["paths"]]
            route = next((p for regex, p in self.paths if regex.match(scope["path"])), None)
        return route or "unmatched"


def _job_id(scope, start_message) -> str | None:
    """The job a request concerns: its path names it, or (a submit) its Location does."""
    jid = scope.get("path_params", {}).get("job_id")
    if jid is None:
        location = dict(start_message.get("headers", ())).get(b"location", b"")
        if location.startswith(b"/v1/jobs/"):
            jid = location.rsplit(b"/", 1)[1].decode()
    return jid


# Each queue's head (the shard taken next) and when rq queued it: one script, so the scrape
# stays one round trip. '' for an empty queue.
HEADS = """
local out = {}
for i, key in ipairs(KEYS) do
  local id = redis.call('LINDEX', key, 0)
  out[i] = id and (redis.call('HGET', ARGV[1] .. id, 'enqueued_at') or '') or ''
end
return out
"""


class Jobs:
    """Shards in Redis by queue and status, from rq's queue lists and registries, and the
    age of each queue's head, in one round trip (LLEN, ZCARDs, a script): what the fleet has
    to do now, and how long it has waited. rq forgets a shard once it ended; a job's outcome
    is the job's own (GET /v1/jobs)."""

    STATUSES = ("scheduled", "running")

    def __init__(self, conn: redis.Redis):
        self.conn = conn

    def collect(self):
        try:
            # Every known model's queues (jobs/models.py): one that waits for its workers too.
            queues = [(m, p, Queue(queue_name(m, p), connection=self.conn))
                      for m in sorted(fleet.read(self.conn)) for p in PRIORITIES]
            with self.conn.pipeline(transaction=False) as pipe:
                for _, _, q in queues:
                    pipe.llen(q.key)
                    for reg in (q.scheduled_job_registry, q.started_job_registry):
                        pipe.zcard(reg.key)
                pipe.eval(HEADS, len(queues), *[q.key for _, _, q in queues],
                          Queue.job_class.redis_job_namespace_prefix)
                pipe.info("memory")
                *counts, heads, memory = pipe.execute()
        except redis.RedisError:
            counts = None
        now = time.time()
        yield GaugeMetricFamily("fanout_api_redis_up", "Whether this scrape reached Redis",
                                value=int(counts is not None))
        if counts is None:
            return
        # Past maxmemory (noeviction) Redis refuses writes: the service pauses until memory is
        # freed (jobs/unavailable.py). Alert before: used / max (max 0: no limit).
        yield GaugeMetricFamily("fanout_redis_memory_used_bytes", "Redis's used_memory",
                                value=memory["used_memory"])
        yield GaugeMetricFamily("fanout_redis_memory_max_bytes", "Redis's maxmemory (0: no limit)",
                                value=memory.get("maxmemory", 0))
        jobs = GaugeMetricFamily("fanout_shards", "Shards of jobs in Redis by rq queue (a model's, at a "
                                 "priority) and status (status queued: the queue's length)",
                                 labels=["queue", "model", "priority", "status"])
        per_queue = 1 + len(self.STATUSES)
        for i, (model, priority, q) in enumerate(queues):
            for status, n in zip(("queued",) + self.STATUSES, counts[i * per_queue:(i + 1) * per_queue]):
                jobs.add_metric([q.name, model, priority, status], n)
        yield jobs
        # A shard handed back goes to the front, queued anew: the head is the next one taken,
        # and its age how long the queue has waited for a worker to take anything (0: empty).
        age = GaugeMetricFamily("fanout_queue_head_age_seconds", "Seconds since rq queued the shard at the "
                                "head of the queue (the next one taken; 0: the queue is empty)",
                                labels=["queue", "model", "priority"])
        for (model, priority, q), at in zip(queues, heads):
            at = at.decode() if isinstance(at, bytes) else at
            age.add_metric([q.name, model, priority], max(0.0, now - utcparse(at).timestamp()) if at else 0.0)
        yield age


def exposition(conn: redis.Redis) -> bytes:
    """The text of a scrape: this process's metrics (or, in multiprocess mode, every
    process's) and the jobs in Redis."""
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        MultiProcessCollector(registry)
    else:
        registry.register(REGISTRY)
    registry.register(Jobs(conn))
    return generate_latest(registry)
