"""The whole service for end-to-end tests: a real Redis (REDIS_URL if set, else an embedded
server), a tiny random-weight model, two API processes (any serves any job) and a worker
process, all over real sockets. Everything waits with bounded timeouts."""
import contextlib
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import redis as redis_lib

from cli.redis_server import EmbeddedRedis, free_port
from jobs.redis_url import connect
from results import keys
from worker.engine.models.tiny import build_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Small limits so the 422 tests can hit them; a short SSE keep-alive.
LIMITS = {"FANOUT_MAX_BATCH": "64", "FANOUT_MAX_NEW_TOKENS": "1000", "FANOUT_MAX_N": "8",
          "FANOUT_MAX_BODY_BYTES": "200000", "FANOUT_RESULT_TTL": "3600", "FANOUT_SSE_KEEPALIVE": "1"}


def entries(r, job_id) -> list[dict]:
    """The job's stream entries, decoded, in order."""
    from results import events, keys
    return [events.decode(f) for _, f in r.xrange(keys.stream(job_id))]


def follow_stream(r, job_id: str, seconds: int = 600) -> None:
    """Set the job's followed flag, as a follower does (keys.followed): its workers send its
    deltas too, which a test reading the stream raw waits for."""
    r.set(keys.followed(keys.stream(job_id)), 1, ex=seconds)


def later(seconds=3600) -> str:
    """An ISO time `seconds` from now (a run_at that keeps a job scheduled)."""
    return (datetime.now(timezone.utc) + timedelta(seconds=seconds)).isoformat()


def fanout(*args):
    """`fanout ARGS` run to its end (the operator's commands: keys, ...)."""
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT})


def http(url, key=None) -> httpx.Client:
    """A client of the API at `url`, with `key` as its bearer token if given."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=url, headers=headers, timeout=10)


def wait_for(cond, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="session")
def redis_url():
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    server = EmbeddedRedis()
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def redis(redis_url):
    client = redis_lib.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("service") / "llama"), arch="llama")


def _env(redis_url):
    return {**os.environ, **LIMITS, "REDIS_URL": redis_url, "PYTHONPATH": ROOT}


class Proc:
    """`fanout ARGS` as a process; `wrap`: a command it runs under (e.g. unshare, nsenter)."""

    def __init__(self, args, env, log_path, wrap=()):
        self.log_path = log_path
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen([*wrap, sys.executable, "-m", "cli.main", *args], env=env, cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.alive():
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def tail(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-3000:].decode(errors="replace")


def start_api(redis_url, log_dir, name, args=(), env=None, wrap=()):
    """`args`: more flags, e.g. --workers 2; `env`: more environment; `wrap`: see Proc."""
    port = free_port()
    proc = Proc(["api", "--port", str(port), "--redis-url", redis_url, *args],
                {**_env(redis_url), **(env or {})}, str(log_dir / f"{name}.log"), wrap)
    url = f"http://127.0.0.1:{port}"

    def up():
        if not proc.alive():
            raise RuntimeError(f"API exited:\n{proc.tail()}")
        try:
            return httpx.get(url + "/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, 60, "the API to answer /healthz")
    return proc, url


@pytest.fixture(scope="session")
def input_root(tmp_path_factory):
    """The folder whose files a dataset job may name by file:// URL (FANOUT_INPUT_ROOT)."""
    return tmp_path_factory.mktemp("datasets")


@pytest.fixture(scope="session")
def api_pair(redis_url, tmp_path_factory, input_root):
    """Two API processes on different ports: the API keeps no state of its own."""
    logs = tmp_path_factory.mktemp("logs")
    procs = [start_api(redis_url, logs, f"api{i}", env={"FANOUT_INPUT_ROOT": str(input_root)}) for i in range(2)]
    yield [url for _, url in procs]
    for p, _ in procs:
        p.stop()


@pytest.fixture(scope="session")
def api_url(api_pair):
    return api_pair[0]


class WorkerProc:
    """The worker process; tests may stop it (SIGTERM) and start a new one."""

    def __init__(self, redis_url, model_dir, log_dir, env=None, args=(), wrap=()):
        self.redis_url, self.model_dir, self.log_dir = redis_url, model_dir, log_dir
        self.env = env or {}  # extra environment, e.g. FANOUT_HEARTBEAT_TTL
        self.args = list(args)  # more flags, e.g. --metrics-port
        self.wrap = list(wrap)  # a command it runs under (Proc)
        self.count = 0
        self.proc = None
        self.name = None

    @property
    def ref(self) -> str:
        """What the job's readers see of this worker (stream attempt entries, shards.workers)."""
        from results.events import worker_ref
        return worker_ref(self.name)

    def start(self, wait: bool = True):
        """Start it; `wait`: until it has registered (its model loaded), else return at once."""
        from rq.worker import Worker
        self.count += 1
        self.name = f"test-worker-{os.getpid()}-{os.urandom(3).hex()}-{self.count}"
        self.proc = Proc(["worker", "--model", self.model_dir, "--device", "cpu", "--name", self.name,
                          "--redis-url", self.redis_url, "--drain-timeout", "0", *self.args],
                         {**_env(self.redis_url), **self.env}, str(self.log_dir / f"{self.name}.log"), self.wrap)
        if not wait:
            return
        conn = connect(self.redis_url)  # a redis+sentinel:// URL too

        def registered():
            if not self.proc.alive():
                raise RuntimeError(f"worker exited:\n{self.proc.tail()}")
            # Registered (it has its model loaded) and ready: its model is listed (run() says
            # idle only after that); it may be busy at once with a waiting job.
            w = Worker.find_by_key(Worker.redis_worker_namespace_prefix + self.name, connection=conn)
            return w is not None and w.get_state() in ("idle", "busy")

        wait_for(registered, 90, "the worker to register with rq")
        conn.close()

    def stop(self, sig=signal.SIGTERM) -> int:
        return self.proc.stop(sig)


@contextlib.contextmanager
def own_service(model, logs, name, args=()):
    """A service of its own beside the session's: an embedded Redis, an API and one worker
    serving `model` as `name` (more worker flags in `args`). Yields (API url, Redis url);
    stops the three after."""
    server = EmbeddedRedis()
    api, url = start_api(server.url, logs, f"api-{name}")
    worker = WorkerProc(server.url, model, logs, args=["--served-model-name", name, *args])
    worker.start()
    try:
        yield url, server.url
    finally:
        worker.stop()
        api.stop()
        server.stop()


def worker_pid(redis_url) -> int:
    """The pid of the one worker registered with a service's own Redis (own_service's)."""
    from rq.worker import Worker
    conn = connect(redis_url)
    try:
        [w] = Worker.all(connection=conn)
        return int(w.pid)
    finally:
        conn.close()


@pytest.fixture(scope="session")
def worker(redis_url, model_dir, tmp_path_factory):
    w = WorkerProc(redis_url, model_dir, tmp_path_factory.mktemp("worker-logs"))
    w.start()
    yield w
    w.stop()


@pytest.fixture(scope="session")
def engine(model_dir):
    """The same model in this process: the reference the service must match."""
    from worker.engine import Engine
    return Engine(model_dir, device="cpu")


@pytest.fixture
def client(api_url, worker):
    from results.client import Client
    with Client(api_url) as c:
        yield c
