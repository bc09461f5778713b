"""A worker's Prometheus metrics, served on `fanout worker --metrics-port`: what its loop
counts (job outcomes, samples, prompt and cache-hit tokens, reaped jobs, Redis outages, step
time) and what its engine holds, read at each scrape (tokens through prefill and decode,
requests, KV pages). Every series but the process ones has the label worker=<its rq name>;
fanout_worker_info{worker, model, task} (always 1) names the model it serves, so a query can
take a model's workers: `... * on (worker) group_left (model) fanout_worker_info`.

A scrape runs in the HTTP server's thread and reads the engine's counters without a lock:
each value is read whole, but two of them may be a step apart.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# A step takes ~1 ms (a GPU decode batch) to seconds (a long prefill chunk on a CPU).
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class WorkerMetrics:
    def __init__(self, name: str):
        self.name = name
        # Its own registry: one set of series per Consumer, whatever else the process holds.
        self.registry = CollectorRegistry()
        # process_start_time_seconds: a worker that crashed and was restarted shows there.
        ProcessCollector(registry=self.registry)

        def counter(metric, doc, *labels):
            return Counter(metric, doc, ["worker", *labels], registry=self.registry)

        self.step_seconds = Histogram("fanout_step_seconds", "Wall time of one engine step", ["worker"],
                                      buckets=STEP_BUCKETS, registry=self.registry).labels(name)
        self._attempts = counter("fanout_job_attempts", "Shard attempts this worker ended, by outcome: "
                                 "succeeded, failed, retried, canceled, handed_back, held, dropped", "outcome")
        self._reaped = counter("fanout_reaped_jobs", "Shards of dead workers this worker reaped, by outcome: "
                               "retried, failed, canceled", "outcome")
        self._samples = counter("fanout_samples", "Samples finished, by finish_reason", "finish_reason")
        self.prompt_tokens = counter("fanout_prompt_tokens", "Prompt tokens of finished samples").labels(name)
        self.cache_hit_tokens = counter("fanout_prefix_cache_hit_tokens", "Prompt tokens of finished "
                                        "samples served from the prefix cache").labels(name)
        self.redis_outages = counter("fanout_redis_outages", "Times the worker paused for Redis").labels(name)
        self.redis_outage_seconds = counter("fanout_redis_outage_seconds",
                                            "Seconds paused for Redis").labels(name)

    def attempt(self, outcome: str) -> None:
        self._attempts.labels(self.name, outcome).inc()

    def reaped(self, outcome: str) -> None:
        self._reaped.labels(self.name, outcome).inc()

    def sample(self, finish_reason: str, usage: dict | None) -> None:
        self._samples.labels(self.name, finish_reason).inc()
        if usage:
            self.prompt_tokens.inc(usage["prompt_tokens"])
            self.cache_hit_tokens.inc(usage["cached_tokens"])

    def watch(self, engine, attempts) -> None:
        """Read the engine and the running attempts (worker/attempts.py) at each scrape."""
        self.registry.register(_EngineState(engine, attempts, self.name))

    def serve(self, port: int, host: str) -> None:
        """An HTTP server in a daemon thread: any path answers the exposition."""
        start_http_server(port, host, registry=self.registry)


class _EngineState:
    def __init__(self, engine, attempts, name: str):
        self.engine, self.attempts, self.labels = engine, attempts, [name]

    def collect(self):
        stats = self.engine.stats()

        def family(kind, metric, doc, value):
            f = kind(metric, doc, labels=["worker"])
            f.add_metric(self.labels, value)
            return f

        info = GaugeMetricFamily("fanout_worker_info", "The model this worker serves (its name in requests "
                                 "and queues) and its task (generate, embed); always 1",
                                 labels=["worker", "model", "task"])
        info.add_metric([*self.labels, self.attempts.member.model, self.engine.task], 1)
        yield info
        # The counters' names get _total in the exposition.
        yield family(CounterMetricFamily, "fanout_prefill_tokens", "Tokens run through prefill (prompts "
                     "not served by the prefix cache, and recomputation)", stats.prefill_tokens)
        yield family(CounterMetricFamily, "fanout_decode_tokens", "Tokens decoded (each sample's first "
                     "token comes out of its prefill)", stats.decode_tokens)
        yield family(CounterMetricFamily, "fanout_retractions", "Requests sent back to waiting (the KV "
                     "cache ran short, or another job needed its fair share of the slots)", stats.retractions)
        yield family(CounterMetricFamily, "fanout_engine_step_failures", "Engine steps that raised (the "
                     "requests that caused it end with an error; the rest carry on)", stats.failed_steps)
        yield family(GaugeMetricFamily, "fanout_requests_running", "Requests holding KV",
                     stats.running)
        yield family(GaugeMetricFamily, "fanout_requests_waiting", "Requests waiting for KV",
                     stats.waiting)
        total, free, cached = stats.kv_pages_total, stats.kv_pages_free, stats.kv_pages_cached
        yield family(GaugeMetricFamily, "fanout_kv_pages_capacity", "KV cache pages", total)
        yield family(GaugeMetricFamily, "fanout_kv_pages_used", "KV pages held by requests alone",
                     total - free - cached)
        yield family(GaugeMetricFamily, "fanout_kv_pages_cached", "KV pages in the prefix cache "
                     "(some shared by running requests; the rest evicted when needed)", cached)
        yield family(GaugeMetricFamily, "fanout_jobs_in_flight", "Shards whose requests are in the engine",
                     len(self.attempts.active))
