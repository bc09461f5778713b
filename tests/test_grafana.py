"""The monitoring files in deploy/, checked by parsing (no Docker engine, no network): compose
mounts files that exist, Prometheus scrapes the API and every worker where compose runs them,
the Grafana board and the alert rules are well formed, and every metric their PromQL names is
one the service exports. The exported names are read from the code: the API's exposition
(api/metrics.py, on a real embedded Redis) and a worker's (worker/metrics.py, on a stub
engine), each family expanded as Prometheus sees it (a counter `x` as `x_total`, a histogram
as `x_bucket`, `x_sum`, `x_count`)."""
import asyncio
import json
import os
import re
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cli import redis_server
from cli.main import parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "dashboards", "fanout.json")
ALERTS = os.path.join(ROOT, "deploy", "prometheus", "alerts.yml")
PROMETHEUS = os.path.join(ROOT, "deploy", "prometheus", "prometheus.yml")
# Series Prometheus makes itself for every target, not the service.
SYNTHETIC = {"up"}


def load_yaml(path):
    with open(path) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def services():
    return load_yaml(os.path.join(ROOT, "compose.yaml"))["services"]


@pytest.fixture(scope="module")
def dashboard():
    with open(DASHBOARD) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def rules():
    return [r for g in load_yaml(ALERTS)["groups"] for r in g["rules"]]


def bind_mounts(service: dict) -> dict[str, str]:
    """{container path: path in the repo} of a service's bind mounts (`./...:/path[:ro]`)."""
    out = {}
    for v in service.get("volumes") or []:
        src, dst, *mode = v.split(":")
        if src.startswith("./"):
            assert mode == ["ro"], f"{v}: mount the repo's files read-only"
            out[dst] = os.path.normpath(os.path.join(ROOT, src))
    return out


def in_repo(mounts: dict[str, str], container_path: str) -> str:
    """The repo path a container path reaches through the bind mounts (the longest one)."""
    for dst in sorted(mounts, key=len, reverse=True):
        if container_path == dst or container_path.startswith(dst.rstrip("/") + "/"):
            return os.path.normpath(os.path.join(mounts[dst], os.path.relpath(container_path, dst)))
    raise AssertionError(f"{container_path} is not mounted from the repo: {mounts}")


def parse_command(cmd: list[str], monkeypatch):
    monkeypatch.setenv("FANOUT_MODEL", "dummy")
    assert cmd[0] == "fanout", cmd
    return parser().parse_args(cmd[1:])


# -- PromQL: the metric names of an expression ----------------------------------------------

KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
            "offset", "bool", "atan2", "inf", "nan", "start", "end"}
TOKEN = re.compile(r"""
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$\w+|\[\[\w+\]\])                       # Grafana's variables
  | (?P<number>0x[0-9a-fA-F]+|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?(?:ms|[smhdwy])?(?:\d+(?:ms|[smhdwy]))*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<open>[({\[])
  | (?P<close>[)}\]])
  | (?P<space>\s+)
  | (?P<other>.)
""", re.X)


def metric_names(expr: str) -> set[str]:
    """Every metric an expression selects: an identifier followed by `{`, `[` or nothing,
    outside label matchers, `by`/`without`/`on`/`ignoring`/`group_*` label lists and
    strings, and not a function (followed by `(`), an aggregation or a keyword. A selector
    by `{__name__="x"}` counts as x."""
    tokens = [(m.lastgroup, m.group()) for m in TOKEN.finditer(expr) if m.lastgroup != "space"]
    names, i = set(), 0
    label_list = {"by", "without", "on", "ignoring", "group_left", "group_right"}
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else (None, None)
        if kind == "open" and text == "{":
            # Label matchers: skip to the closing brace, keeping a __name__ matcher's value.
            j = i + 1
            while tokens[j][1] != "}":
                if tokens[j] == ("ident", "__name__") and tokens[j + 2][0] == "string":
                    names.add(tokens[j + 2][1][1:-1])
                j += 1
            i = j + 1
            continue
        if kind == "open" and text == "[":  # a range or a subquery's: durations, variables
            j = i
            while tokens[j][1] != "]":
                j += 1
            i = j + 1
            continue
        if kind == "ident":
            word = text.lower()
            if word in label_list and nxt[1] == "(":
                j = i + 2
                while tokens[j][1] != ")":  # label names, not metrics
                    j += 1
                i = j + 1
                continue
            if word in label_list or word in KEYWORDS or nxt[1] == "(" or \
                    (nxt[0] == "ident" and nxt[1].lower() in ("by", "without")):
                i += 1  # a keyword, a function, an aggregation (`sum by (x) (...)` too)
                continue
            names.add(text)
        i += 1
    return names


def variable_names(query) -> set[str]:
    """The metrics a Grafana template variable's Prometheus query names."""
    text = query.get("query", "") if isinstance(query, dict) else (query or "")
    m = re.fullmatch(r"\s*label_values\(\s*(?:(.*),\s*)?(\w+)\s*\)\s*", text)
    if m:  # label_values(selector, label): the label is not a metric
        return metric_names(m.group(1) or "")
    m = re.fullmatch(r"\s*(?:query_result|metrics)\((.*)\)\s*", text)
    return metric_names(m.group(1) if m else text)


def test_the_extractor_finds_metrics_and_nothing_else():
    cases = {
        'sum by (model) (rate(fanout_decode_tokens_total[$__rate_interval]) * on (worker) '
        'group_left (model) fanout_worker_info{model=~"$model"})': {"fanout_decode_tokens_total", "fanout_worker_info"},
        'histogram_quantile(0.95, sum by (le, route) (rate(x_bucket{status=~"5.."}[5m:1m] offset 1h)))': {"x_bucket"},
        "a / b > 0.85 and c > 0": {"a", "b", "c"},
        "sum without (instance) (a) unless ignoring (job) b": {"a", "b"},
        'label_replace(up{job="x"}, "dst", "$1", "src", "(.*)")': {"up"},
        '{__name__="named_metric", job="j"} + 1e3 + 0x1F + 5m': {"named_metric"},
        "max(a:recorded:rate5m) by (model) or on() vector(0)": {"a:recorded:rate5m"},
        "increase(foo_total[${__range}]) @ end()": {"foo_total"},
    }
    for expr, want in cases.items():
        assert metric_names(expr) == want, expr
    assert variable_names({"query": "label_values(fanout_shards, model)"}) == {"fanout_shards"}
    assert variable_names("label_values(model)") == set()


# -- What the service exports --------------------------------------------------------------

SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "info": ("_info",),
            "gaugehistogram": ("_bucket", "_gsum", "_gcount")}


def exported(text: str) -> set[str]:
    """The series names an exposition gives Prometheus: every family's, as its type expands
    it, whether or not it has samples yet (a labelled metric has none until first used)."""
    out = set()
    for f in text_string_to_metric_families(text):
        out.update(f.name + s for s in SUFFIXES.get(f.type, ("",)))
        out.update(s.name for s in f.samples)
    return out


class StubEngine:
    task = "generate"

    def stats(self):
        from worker.engine.engine import EngineStats
        return EngineStats(prefill_tokens=10, decode_tokens=20, retractions=0, failed_steps=0, running=2,
                           waiting=1, kv_pages_total=100, kv_pages_free=60, kv_pages_cached=10)


def worker_exposition() -> str:
    from worker.metrics import WorkerMetrics
    metrics = WorkerMetrics("fanout-w1")
    metrics.watch(StubEngine(), SimpleNamespace(active={}, member=SimpleNamespace(model="chat-model")))
    return generate_latest(metrics.registry).decode()


@pytest.fixture(scope="module")
def redis_conn():
    import redis as redis_lib
    server = redis_server.EmbeddedRedis()
    try:
        yield redis_lib.Redis.from_url(server.url)
    finally:
        server.stop()


@pytest.fixture()
def known_model(monkeypatch):
    monkeypatch.setenv("FANOUT_MODELS", "chat-model")  # known with no worker: its queues are counted
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    return "chat-model"


@pytest.fixture()
def exported_names(redis_conn, known_model) -> set[str]:
    from api import metrics
    api = metrics.exposition(redis_conn).decode()
    assert "fanout_api_redis_up 1.0" in api  # the scrape reached Redis: its families are all there
    return exported(api) | exported(worker_exposition())


def unknown(exprs: dict[str, str], names: set[str]) -> list[str]:
    """'where: metric' for each metric an expression names that is not exported."""
    return sorted(f"{where}: {m}" for where, expr in exprs.items()
                  for m in metric_names(expr) - names - SYNTHETIC)


def queries(dashboard: dict, rules: list[dict]) -> dict[str, str]:
    out = {f"panel {p['id']} {p['title']!r} {t['refId']}": t["expr"]
           for p in dashboard["panels"] for t in p.get("targets", [])}
    out.update({f"alert {r['alert']}": r["expr"] for r in rules})
    return out


def test_every_metric_the_board_and_the_alerts_query_is_exported(dashboard, rules, exported_names):
    exprs = queries(dashboard, rules)
    assert unknown(exprs, exported_names) == []
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            assert variable_names(v["query"]) - exported_names == set(), v["name"]
    used = set().union(*map(metric_names, exprs.values()))
    # The check can fail: a made-up name, or a counter queried without its _total, is caught.
    bad = dict(exprs, made_up='sum(rate(fanout_made_up_total{model="m"}[5m]))',
               no_suffix="rate(fanout_decode_tokens[5m])")
    assert unknown(bad, exported_names) == ["made_up: fanout_made_up_total", "no_suffix: fanout_decode_tokens"]
    # Both sides are real: the API's and a worker's families, with their suffixes.
    assert {"fanout_api_requests_total", "fanout_api_request_duration_seconds_bucket", "fanout_shards",
            "fanout_step_seconds_bucket", "fanout_decode_tokens_total", "fanout_worker_info"} <= used & exported_names


def test_the_board_shows_what_the_issue_asks_for(dashboard):
    """Queue depth and age, tokens/s, samples/s, step time, KV use, Redis outages, reaped
    shards, API latency and 5xx, streams open, Redis memory: each by a panel's query."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = set().union(*map(metric_names, exprs))
    for item, metric in {"queue depth": "fanout_shards", "queue age": "fanout_queue_head_age_seconds",
                         "tokens/s": "fanout_decode_tokens_total", "samples/s": "fanout_samples_total",
                         "step time": "fanout_step_seconds_bucket", "KV use": "fanout_kv_pages_used",
                         "Redis outages": "fanout_redis_outages_total", "Redis up": "fanout_api_redis_up",
                         "reaped shards": "fanout_reaped_jobs_total",
                         "API latency": "fanout_api_request_duration_seconds_bucket",
                         "streams open": "fanout_api_streams_open",
                         "Redis memory": "fanout_redis_memory_used_bytes"}.items():
        assert metric in used, item
    assert any("fanout_api_requests_total" in e and 'status=~"5.."' in e for e in exprs)  # 5xx
    assert any("rate(fanout_decode_tokens_total" in e for e in exprs)  # a rate, not a count


def test_panels_are_well_formed(dashboard):
    assert dashboard["uid"] == "fanout" and 36 <= dashboard["schemaVersion"] <= 41
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["includeAll"] and variables["model"]["allValue"] == ".*"
    for p in dashboard["panels"]:
        x, w = p["gridPos"]["x"], p["gridPos"]["w"]
        assert 0 <= x and x + w <= 24, p["title"]
        if p["type"] == "row":
            assert not p.get("targets") and p["panels"] == [], p["title"]
            continue
        assert p["type"] in ("timeseries", "stat", "gauge"), p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and metric_names(t["expr"]), (p["title"], t["expr"])
            assert t["datasource"] == p["datasource"]
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var.startswith("__") or var in variables, (p["title"], var)
    # The worker panels take a model's workers through fanout_worker_info.
    assert sum('fanout_worker_info{model=~"$model"}' in t["expr"]
               for p in dashboard["panels"] for t in p.get("targets", [])) >= 10


def test_alert_rules_are_complete(rules):
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for r in rules:
        assert r["expr"].strip() and metric_names(r["expr"]), r["alert"]
        assert re.fullmatch(r"(\d+[smh])+", r["for"]), r["alert"]
        assert r["labels"]["severity"] in ("critical", "warning", "info"), r["alert"]
        assert r["annotations"]["summary"].strip(), r["alert"]
    used = set().union(*(metric_names(r["expr"]) for r in rules))
    assert {"fanout_api_redis_up", "fanout_queue_head_age_seconds", "fanout_api_requests_total",
            "fanout_reaped_jobs_total", "fanout_kv_pages_used", "fanout_shards",
            "fanout_redis_memory_used_bytes"} <= used


# -- compose and Prometheus's configuration ------------------------------------------------

def test_compose_runs_prometheus_and_grafana_on_files_in_the_repo(services):
    prom, graf = services["prometheus"], services["grafana"]
    assert re.fullmatch(r"prom/prometheus:v3\.\d+\.\d+", prom["image"])  # pinned, not latest
    assert re.fullmatch(r"grafana/grafana:12\.\d+\.\d+", graf["image"])
    for svc in (prom, graf):
        for path in bind_mounts(svc).values():
            assert os.path.exists(path), path
    pm = bind_mounts(prom)
    assert in_repo(pm, "/etc/prometheus/prometheus.yml") == PROMETHEUS  # the image's default config path
    config = load_yaml(PROMETHEUS)
    for rule_file in config["rule_files"]:
        path = in_repo(pm, os.path.join("/etc/prometheus", rule_file))  # relative to the config
        assert path == ALERTS and os.path.isfile(path)
    # Grafana: its provisioning folder (the image's default), the data source, the board.
    gm = bind_mounts(graf)
    datasources = load_yaml(in_repo(gm, "/etc/grafana/provisioning/datasources/prometheus.yml"))
    [ds] = datasources["datasources"]
    assert ds["type"] == "prometheus" and ds["isDefault"]
    assert ds["url"] == "http://prometheus:9090"  # the compose service, Prometheus's port
    [provider] = load_yaml(in_repo(gm, "/etc/grafana/provisioning/dashboards/fanout.yml"))["providers"]
    assert provider["type"] == "file"
    board = os.path.join(in_repo(gm, provider["options"]["path"]), "fanout.json")
    assert os.path.samefile(board, DASHBOARD)
    home = graf["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert os.path.samefile(in_repo(gm, home), DASHBOARD)
    assert graf["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"  # anonymous users only view
    # Published on loopback unless the operator says otherwise, like the API.
    assert prom["ports"] == ["${FANOUT_MONITORING_BIND:-127.0.0.1}:9090:9090"]
    assert graf["ports"] == ["${FANOUT_MONITORING_BIND:-127.0.0.1}:3000:3000"]


def test_prometheus_scrapes_the_api_and_every_worker_replica(services, monkeypatch):
    jobs = {j["job_name"]: j for j in load_yaml(PROMETHEUS)["scrape_configs"]}

    def targets(job):
        assert job.get("metrics_path", "/metrics") == "/metrics"
        out = set()
        for sd in job["dns_sd_configs"]:  # every replica: Docker's DNS gives them all
            assert sd["type"] == "A"
            out.update((name, sd["port"]) for name in sd["names"])
        return out

    api = parse_command(services["api"]["command"], monkeypatch)
    assert targets(jobs["fanout-api"]) == {("api", api.port)}
    workers = {name: parse_command(s["command"], monkeypatch) for name, s in services.items()
               if s.get("command", [None, None])[1:2] == ["worker"]}
    assert set(workers) == {"worker", "worker-embed"}
    for name, args in workers.items():
        # Served on all interfaces: reachable from the prometheus container.
        assert args.metrics_port is not None and args.metrics_host == "0.0.0.0", name
        assert str(args.metrics_port) in [str(p) for p in services[name].get("expose", [])], name
    assert targets(jobs["fanout-worker"]) == {(name, args.metrics_port) for name, args in workers.items()}


# -- The metrics added for the board -------------------------------------------------------

def test_queue_head_age_is_how_long_the_next_shard_has_waited(redis_conn, known_model):
    from rq import Queue

    from api import metrics
    from jobs.spec import queue_name

    def ages():
        fams = {f.name: f for f in metrics.Jobs(redis_conn).collect()}
        return {s.labels["priority"]: s.value for s in fams["fanout_queue_head_age_seconds"].samples
                if s.labels["model"] == known_model}

    assert ages() == {"high": 0.0, "normal": 0.0, "low": 0.0}  # empty queues
    q = Queue(queue_name(known_model, "normal"), connection=redis_conn)
    first = q.enqueue("builtins.print")
    q.enqueue("builtins.print")
    try:
        redis_conn.hset(first.key, "enqueued_at", "2020-01-01T00:00:00.000000Z")  # the head, queued long ago
        age = ages()
        assert age["high"] == age["low"] == 0.0 and age["normal"] > 5 * 365 * 86400
        q.remove(first)  # the next one, queued just now, is the head
        assert 0 <= ages()["normal"] < 60
    finally:
        q.empty()


def test_streams_open_counts_event_streams_while_they_are_sent():
    from api import metrics

    route = "/v1/jobs/{job_id}/events"

    def value():
        return REGISTRY.get_sample_value("fanout_api_streams_open", {"route": route}) or 0.0

    seen = []

    async def app(scope, receive, send):
        sse = scope["path"].endswith("/events")
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8" if sse else b"application/json")]})
        seen.append(value())
        if scope["path"].endswith("/broken/events"):
            raise RuntimeError("the stream broke")
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": False})

    meter = metrics.RequestMetrics(app, openapi=lambda: {"paths": {route: {}, "/v1/jobs/{job_id}": {}}})

    async def call(path):
        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            pass

        await meter({"type": "http", "method": "GET", "path": path, "headers": []}, receive, send)

    before = value()
    asyncio.run(call("/v1/jobs/abc/events"))
    asyncio.run(call("/v1/jobs/abc"))
    with pytest.raises(RuntimeError):
        asyncio.run(call("/v1/jobs/broken/events"))
    assert seen == [before + 1, before, before + 1]  # open while sent; a JSON answer is no stream
    assert value() == before  # closed at the end, even one that raised


def test_worker_info_names_the_model_of_each_worker():
    fams = {f.name: f for f in text_string_to_metric_families(worker_exposition())}
    [s] = fams["fanout_worker_info"].samples
    assert s.labels == {"worker": "fanout-w1", "model": "chat-model", "task": "generate"} and s.value == 1
    assert {x.labels["worker"] for x in fams["fanout_kv_pages_used"].samples} == {"fanout-w1"}  # the join key
