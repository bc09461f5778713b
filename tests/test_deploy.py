"""The deployment files, checked by parsing (no Docker engine here): compose.yaml, the
Dockerfile and .dockerignore. The commands in compose.yaml go through the real `fanout`
argument parser, and the healthchecks' Python code runs against a stub server and a real
(embedded) Redis."""
import datetime
import fnmatch
import http.server
import json
import os
import re
import shlex
import socket
import threading

import pytest
import yaml

from cli import redis_server
from cli.main import parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FANOUT = ("api", "worker", "worker-embed", "cron")  # the services that run the image
PASSWORD_VAR = "REDIS_PASSWORD"


@pytest.fixture(scope="module")
def compose():
    with open(os.path.join(ROOT, "compose.yaml")) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def services(compose):
    return compose["services"]


@pytest.fixture(scope="module")
def dockerfile() -> list[str]:
    """Instructions, one per item: comments dropped, continuation lines joined."""
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        text = f.read()
    text = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    text = re.sub(r"\\\n", " ", text)
    return [" ".join(ln.split()) for ln in text.splitlines() if ln.strip()]


def env_of(service: dict) -> dict:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return env


def ports_of(service: dict) -> list[str]:
    out = []
    for p in service.get("ports") or []:
        out.append(str(p["target"]) if isinstance(p, dict) else str(p))
    return out


def requires_var(value: str, var: str) -> bool:
    """`${VAR:?msg}` or `${VAR?msg}`: compose refuses to start without VAR."""
    return re.search(r"\$\{" + var + r":?\?[^}]+\}", value) is not None


def test_services(services):
    assert {"redis", "api", "worker", "cron"} <= set(services)
    for name in FANOUT:
        assert services[name].get("build") == "." and services[name]["image"] == "fanout"
    assert services["cron"]["profiles"] == ["cron"]
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]


def test_two_models_each_with_its_workers(services):
    """A chat model's worker and an embedding model's: the same service (command, GPU, volumes,
    store) but for FANOUT_MODEL, so each takes its own model's jobs."""
    chat, embed = services["worker"], services["worker-embed"]
    for key in ("command", "deploy", "volumes", "healthcheck", "stop_grace_period", "image"):
        assert chat[key] == embed[key], key
    assert {k: v for k, v in env_of(chat).items() if k != "FANOUT_MODEL"} == \
        {k: v for k, v in env_of(embed).items() if k != "FANOUT_MODEL"}
    assert env_of(chat)["FANOUT_MODEL"] != env_of(embed)["FANOUT_MODEL"]
    assert "bge-small" in env_of(embed)["FANOUT_MODEL"]  # sentence-transformers' layout: /v1/embeddings


def test_redis_is_private_and_needs_the_password(services):
    redis = services["redis"]
    for name, svc in services.items():
        for port in ports_of(svc):
            assert "6379" not in port, f"{name} publishes Redis's port: {port}"
    assert "network_mode" not in redis
    cmd = redis["command"]
    assert cmd[0] == "redis-server"
    assert requires_var(cmd[cmd.index("--requirepass") + 1], PASSWORD_VAR)
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"])  # the append-only file is kept
    # The healthcheck authenticates (REDISCLI_AUTH) and wants PONG: an unauthenticated
    # `redis-cli ping` exits 0 with a NOAUTH error.
    assert env_of(redis)["REDISCLI_AUTH"] == "${%s}" % PASSWORD_VAR
    test = " ".join(redis["healthcheck"]["test"])
    assert "redis-cli ping" in test and "PONG" in test


def test_every_fanout_service_has_the_password_in_redis_url(services):
    for name in FANOUT:
        url = env_of(services[name])["REDIS_URL"]
        m = re.fullmatch(r"redis://:(\$\{[^}]+\})@redis:6379/\d+", url)
        assert m and requires_var(m.group(1), PASSWORD_VAR), (name, url)
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"


def _parse(cmd: list[str], monkeypatch):
    monkeypatch.setenv("FANOUT_MODEL", "dummy")  # the worker's compose env gives it the model
    assert cmd[0] == "fanout", cmd
    ap = parser()
    sub = next(a for a in ap._actions if a.choices and "worker" in a.choices)
    assert cmd[1] in sub.choices, f"no `fanout {cmd[1]}`"
    return ap.parse_args(cmd[1:])  # SystemExit (pytest fails) on a flag the command lacks


def test_every_command_is_a_fanout_command_with_flags_it_accepts(services, dockerfile, monkeypatch):
    for name in FANOUT:
        args = _parse(services[name]["command"], monkeypatch)
        assert args.cmd == name.removesuffix("-embed")
    cmd = json.loads(dockerfile[-1].removeprefix("CMD "))
    assert _parse(cmd, monkeypatch).cmd == "api"
    worker = _parse(services["worker"]["command"], monkeypatch)
    assert worker.device == "cuda"
    grace = services["worker"]["stop_grace_period"]
    assert re.fullmatch(r"\d+s", grace) and int(grace[:-1]) > worker.drain_timeout + 10


def _code(healthcheck: dict) -> str:
    test = healthcheck["test"]
    assert test[:3] == ["CMD", "python", "-c"], test  # no curl in a slim image; no shell needed
    assert "$" not in test[3]  # compose would interpolate it
    return test[3]


def _exit_code(code: str) -> int:
    try:
        exec(compile(code, "<healthcheck>", "exec"), {})
    except SystemExit as e:
        return 0 if e.code in (None, 0, False) else 1
    except Exception:
        return 1
    return 0


def test_api_healthcheck_calls_healthz_and_fails_on_an_error(services, monkeypatch):
    code = _code(services["api"]["healthcheck"])
    args = _parse(services["api"]["command"], monkeypatch)
    m = re.search(r"http://127\.0\.0\.1:(\d+)/healthz", code)
    assert m and int(m.group(1)) == args.port

    status = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status["code"] if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    try:
        local = code.replace(f":{args.port}/", f":{server.server_port}/")
        assert _exit_code(local) == 0
        status["code"] = 503  # the API up but Redis unreachable
        assert _exit_code(local) == 1
    finally:
        server.shutdown()
        server.server_close()
    assert _exit_code(code.replace(f":{args.port}/", f":{redis_server.free_port()}/")) == 1  # nothing listening


def test_worker_healthcheck_wants_a_fresh_registration_from_this_host(services, monkeypatch):
    import redis as redis_lib
    from rq import Worker

    code = _code(services["worker"]["healthcheck"])
    server = redis_server.EmbeddedRedis()
    try:
        plain = redis_lib.Redis.from_url(server.url)
        plain.config_set("requirepass", "s3cret")  # as in compose: the URL carries the password
        url = f"redis://:s3cret@127.0.0.1:{server.port}/0"
        monkeypatch.setenv("REDIS_URL", url)
        conn = redis_lib.Redis.from_url(url)
        assert _exit_code(code) == 1  # no worker yet (loading its model)
        w = Worker(["fanout"], connection=conn, name="fanout-test-1")
        w.register_birth()
        w.heartbeat()
        assert _exit_code(code) == 0
        stale = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
        conn.hset(w.key, "last_heartbeat", stale.strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
        assert _exit_code(code) == 1  # registered, but no heartbeat for minutes: hung
        w.heartbeat()
        conn.hset(w.key, "hostname", "another-host")
        assert _exit_code(code) == 1  # only a worker in this container counts
        assert socket.gethostname() != "another-host"
    finally:
        server.stop()
    hc = services["worker"]["healthcheck"]
    assert _seconds(hc["start_period"]) >= 300  # the model loads before the worker registers


def _seconds(text: str) -> int:
    return sum(int(n) * {"s": 1, "m": 60, "h": 3600}[u] for n, u in re.findall(r"(\d+)([smh])", text))


def test_image_runs_as_a_non_root_user_after_the_installs(dockerfile):
    users = [i for i, ln in enumerate(dockerfile) if ln.startswith("USER ")]
    assert users, "no USER: the image runs as root"
    user = dockerfile[users[-1]].split()[1].split(":")[0]
    assert user not in ("root", "0")
    runs = [i for i, ln in enumerate(dockerfile) if ln.startswith("RUN ")]
    assert users[-1] > max(runs)  # the installs ran as root, the processes do not
    creates = next(ln for ln in dockerfile if ln.startswith("RUN ") and "useradd" in ln)
    uid = re.search(r"--uid (\d+)", creates)
    assert uid and int(uid.group(1)) >= 1000 and re.search(rf"\b{user}\b", creates)


def test_model_volume_is_writable_by_that_user(services, dockerfile):
    user = next(ln for ln in reversed(dockerfile) if ln.startswith("USER ")).split()[1]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["worker"]["volumes"]}
    assert mounts.get("/models") == "models"  # a named volume takes the image folder's owner
    assert env_of(services["worker"])["HF_HOME"].startswith("/models/")
    chown = [ln for ln in dockerfile if ln.startswith("RUN ") and "chown" in ln]
    assert any(re.search(rf"chown -R {user}(:{user})? /models\b", ln) for ln in chown), chown
    assert any(re.search(r"mkdir -p /models/hf\b", ln) for ln in chown)


def test_blob_volume_is_the_store_of_the_api_and_the_worker_and_writable(services, dockerfile):
    user = next(ln for ln in reversed(dockerfile) if ln.startswith("USER ")).split()[1]
    for name in ("api", "worker"):  # one store: the worker reads the items the API wrote
        mounts = {v.split(":")[1]: v.split(":")[0] for v in services[name]["volumes"]}
        assert mounts.get("/blobs") == "blobs", name
        url = env_of(services[name])["FANOUT_STORAGE_URL"]
        assert re.fullmatch(r"\$\{FANOUT_STORAGE_URL:-file:///blobs\}", url), (name, url)
    chown = [ln for ln in dockerfile if ln.startswith("RUN ") and "chown" in ln]
    assert any(re.search(rf"chown -R {user}(:{user})? .*/blobs\b", ln) for ln in chown), chown


def test_image_has_a_c_compiler_for_triton(dockerfile):
    installs = [ln for ln in dockerfile if ln.startswith("RUN ") and "apt-get install" in ln]
    words = set(shlex.split(" ".join(installs)))
    assert "gcc" in words and "libc6-dev" in words


def test_dockerfile_copies_what_pip_install_needs(dockerfile):
    assert dockerfile[0].startswith("FROM python:3.1")
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        ignore = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]

    def in_context(path: str) -> bool:  # .dockerignore: the last matching pattern wins
        keep = True
        for pat in ignore:
            neg = pat.startswith("!")
            pat = pat.lstrip("!").rstrip("/")
            parts = path.split("/")
            if any(fnmatch.fnmatch("/".join(parts[:i]), pat) for i in range(1, len(parts) + 1)):
                keep = neg
        return keep

    copied = []
    for ln in dockerfile:
        if ln.startswith("COPY"):
            for src in ln.split()[1:-1]:
                assert os.path.exists(os.path.join(ROOT, src)), src
                assert in_context(src), f"{src} is in .dockerignore"
                copied.append(src)
    assert {"pyproject.toml", "README.md", "api", "cli", "jobs", "results", "worker"} <= set(copied)
    for path in (".venv-ci", ".env", ".git", "tests", "worker/__pycache__"):
        assert not in_context(path), path
    assert 'RUN pip install ".[parquet]"' in dockerfile  # the project, with what reads and writes Parquet


def test_compose_spec_schema(compose):
    """The Compose specification's JSON schema, as vendored by check-jsonschema."""
    import importlib.resources

    import jsonschema
    text = (importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
            / "compose-spec.json").read_text()
    jsonschema.validate(compose, json.loads(text))


def test_the_api_is_published_on_loopback_unless_the_operator_says_otherwise(services):
    """With no API keys every client sees every job: compose publishes the API on 127.0.0.1
    unless FANOUT_API_BIND names another address."""
    [port] = services["api"]["ports"]
    assert port == "${FANOUT_API_BIND:-127.0.0.1}:8000:8000"
    for name, svc in services.items():
        if name in ("prometheus", "grafana"):  # the same, unless FANOUT_MONITORING_BIND says otherwise
            assert all(p.startswith("${FANOUT_MONITORING_BIND:-127.0.0.1}:") for p in svc["ports"]), name
        elif name != "api":
            assert not svc.get("ports"), name


def test_no_install_line_names_another_projects_distribution():
    """On PyPI, `fanout` is an unrelated project ("Fanout.io library"): the distribution is
    `fanout-batch` (the command stays `fanout`), and no install line in the docs, the code or
    the Dockerfile names `fanout` or `fanout[...]` as a package to fetch."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["name"] == "fanout-batch" and project["scripts"]["fanout"] == "cli.main:main"
    bad = re.compile(r"pip3? install[^\n`&;|]*?(?<![\w./-])['\"]?fanout(\[[^\]]*\])?['\"]?(?=[\s`'\"]|$)")
    found = []
    for folder, _, names in os.walk(ROOT):
        if any(part in folder for part in (".venv", ".git", "egg-info", "__pycache__", "bench/out")):
            continue
        for name in names:
            if name == "test_deploy.py":  # this test's own examples, below
                continue
            if name.endswith((".md", ".py", ".toml", ".yaml", ".sh")) or name in ("Dockerfile", "run"):
                path = os.path.join(folder, name)
                with open(path, errors="replace") as f:
                    found += [f"{os.path.relpath(path, ROOT)}: {m.group(0)}" for m in bad.finditer(f.read())]
    assert found == [], found
    assert bad.search("pip install 'fanout[parquet]'") and bad.search("pip install fanout")
    assert not bad.search("pip install -e '.[parquet]'") and not bad.search("pip install fanout-batch")
    assert not bad.search("pip install -e . && fanout up")
