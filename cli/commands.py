"""What each `fanout` command does (cli/main.py parses the command line and calls
them): run the service (api, worker, cron, up), use it through the API (submit, status,
results, cancel), manage API keys in Redis (keys), or generate offline (generate)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from typing import Any

import redis

from api import batchfile, tenants
from jobs import logs, models, redis_url
from jobs.settings import Settings
from results import blobs, events
from cli.flags import ENGINE_OPTIONS, ENV, WORKER_OPTIONS, engine_config, forward, sampling_from_args

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
    from worker.consumer import Consumer
    from worker.embedder import Embedder
    from worker.embedder.layout import is_embedding_model
    from worker.engine import Engine, freeze_gc
    from worker.engine.lora import parse_specs
    from worker.engine.models.loader import resolve_model_path

    logs.setup()
    if not args.model:
        raise SystemExit("fanout worker: --model (or FANOUT_MODEL) is required")
    settings = Settings.from_env()
    name = args.served_model_name or served_name(args.model)
    embedding = is_embedding_model(resolve_model_path(args.model))  # sentence-transformers' layout
    try:  # jobs for the model (and its LoRA adapters) are taken, and wait queued, while it loads
        conn = redis_url.connect(args.redis_url)
        models.announce_loading(conn, name, "embed" if embedding else "generate")
        for adapter, _ in parse_specs(args.lora):
            models.announce_loading(conn, adapter, "generate", parent=name)
    except redis.RedisError as e:
        logging.getLogger("fanout.worker").warning("cannot announce %s as loading: %s", name, e)
    if embedding:
        engine = Embedder(args.model, engine_config(args))
        freeze_gc()
        logging.getLogger("fanout.worker").info(
            "loaded %s on %s, %s: an embedding model (%s pooling, %d dimensions, inputs up to %d "
            "tokens), batches of up to %d padded tokens", args.model, engine.device,
            str(engine.dtype).removeprefix("torch."), engine.layout.pooling, engine.dim, engine.max_context,
            engine.batch_tokens)
    else:
        engine = Engine(args.model, engine_config(args))
        freeze_gc()
        r = engine.runner
        logging.getLogger("fanout.worker").info(
            "loaded %s on %s, %s; KV cache %d tokens (%d pages of %d), %.0f MiB; up to %d requests at once",
            args.model, r.device, str(r.dtype).removeprefix("torch."), r.kv_tokens,
            r.kv_tokens // args.page_size, args.page_size, r.mem["kv"] / 2**20, args.max_running)
    os.environ["REDIS_URL"] = args.redis_url
    try:  # a worker that could not read its jobs' items stops here, before taking any
        blobs.same_store(redis_url.connect(args.redis_url), blobs.open_store(settings.storage_url))
    except redis.RedisError as e:
        logging.getLogger("fanout.worker").warning("cannot check the blob store against Redis yet: %s", e)
    consumer = Consumer(engine, redis_url.connect(args.redis_url), settings,
                        name=args.name or worker_name(), drain_timeout=args.drain_timeout,
                        delta_interval=args.delta_interval,
                        model=name)
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
    from cli import up

    up.run(args, worker_flags=forward(args, ENGINE_OPTIONS | WORKER_OPTIONS))


def _print_json(obj) -> None:
    print(json.dumps(obj, ensure_ascii=False))


def submit_key(body: dict) -> str:
    """The idempotency key `fanout submit` derives from what it submits: the same file and
    flags again attach to the job they made instead of submitting it twice."""
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return "fanout-submit-" + digest[:40]


def cmd_submit(args) -> None:
    from tqdm import tqdm

    from cli.progress import Progress
    from results.client import Client
    from worker.engine.sampling_params import SamplingParams

    remote = args.file.startswith(URLS)
    body = {**(_url_body(args) if remote else job_body(args.file, args)), "priority": args.priority}
    if args.run_at:
        body["run_at"] = args.run_at
    if args.job_model:
        body["model"] = args.job_model
    if args.metadata:
        body["metadata"] = {k: v for pairs in args.metadata for k, v in pairs.items()}
    # A local file is checked here too: a bad one fails before any upload. A URL's lines the API checks.
    spec = None if remote else job_spec(body, args.file)
    key = args.idempotency_key or (None if args.new else submit_key(body))
    # Past a body's default limits (or asked): the items go up as a dataset file instead.
    d = Settings()
    upload = spec is not None and (args.upload or spec.size > d.max_batch or len(json.dumps(body)) > d.max_body_bytes)
    with Client(args.url, api_key=args.api_key) as client:
        job = _submit_dataset(client, body, key) if upload else client.submit(body, idempotency_key=key)
        again = " (submitted before with this file and these flags: following it; --new submits " \
                "another)" if job.get("replayed") else ""
        size = f"{spec.size} items" if spec else "items being read by the API"
        print(f"job {job['id']} ({size}, seed {job['seed']}){again}", file=sys.stderr)
        if args.no_wait:
            _print_json({k: v for k, v in job.items() if k != "replayed"})
            return
        shared = body.get("sampling_params") if isinstance(body.get("sampling_params"), dict) else {}
        bar = Progress(spec, shared.get("max_new_tokens") or SamplingParams().max_new_tokens,
                       body.get("task") == "embed")
        status = None
        for _, entry in client.events(job["id"]):
            bar.entry(entry, lambda: client.status(job["id"]))
            if entry["type"] in ("final", "error") and args.stream:
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
            batchfile.write_results(client.iter_results(job["id"]), args.out or sys.stdout,
                                    body.get("task") == "embed")


URLS = ("s3://", "file://")  # a dataset the API reads itself (api/dataset.py)


def _url_body(args) -> dict:
    """A POST /v1/jobs body naming the dataset at args.file, with the sampling flags."""
    sp = sampling_from_args(args)
    seed = sp.pop("seed", None)  # the flags are the shared object: their seed is the job seed
    return {"input_url": args.file, "sampling_params": sp, **({"seed": seed} if seed is not None else {})}


def _submit_dataset(client, body: dict, key: str | None) -> dict:
    """Submit `body` as a dataset: its items written to a JSONL file (one line each, with its
    own sampling params and custom id), uploaded, and a job naming it. A replayed job (the
    same content and flags: api/submit.py) keeps its own file; this upload is deleted."""
    kind = next(k for k in batchfile.FIELDS.values() if k in body)
    field = next(f for f, k in batchfile.FIELDS.items() if k == kind)
    sp, ids = body["sampling_params"], body.get("custom_ids")
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", prefix="fanout-dataset-", delete=False) as f:
        for i, item in enumerate(body[kind]):
            line = {field: item}
            if isinstance(sp, list):
                line["sampling_params"] = sp[i]
            if ids and ids[i] is not None:
                line["custom_id"] = ids[i]
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    try:
        file_id = client.upload(f.name, "dataset")["id"]
    finally:
        os.unlink(f.name)
    job = client.submit({"input_file_id": file_id, "sampling_params": sp if isinstance(sp, dict) else {},
                         **{k: body[k] for k in ("seed", "priority", "run_at", "metadata") if k in body}},
                        idempotency_key=key)
    if job["replayed"]:
        client.delete_file(file_id)
    return job


def cmd_status(args) -> None:
    from results.client import Client

    with Client(args.url, api_key=args.api_key) as c:
        print(json.dumps(c.status(args.id), indent=2))


NOT_FINISHED = 3  # exit status of `fanout results` on a job that has not ended


def cmd_results(args) -> None:
    from results.client import Client

    with Client(args.url, api_key=args.api_key) as c:
        info = c.status(args.id)
        ended = info["status"] in events.TERMINAL
        p = info["progress"]
        if not ended and not args.partial:  # nothing written: a file of empty items reads as an answer
            raise SystemExit(f"fanout results: job {args.id} is still {info['status']} ({p['done']} of "
                             f"{p['total']} items finished, {p['samples_done']} of {p['samples']} samples); "
                             "nothing written. Wait for it (fanout status), or add --partial for what has "
                             "finished so far")
        batchfile.write_results(c.iter_results(args.id), args.out or sys.stdout, info.get("task") == "embed")
    if not ended:  # --partial: say so, and exit so that scripts notice
        print(f"fanout results: job {args.id} is {info['status']}: {p['done']} of {p['total']} items "
              "finished; the samples written are those finished so far", file=sys.stderr)
        raise SystemExit(NOT_FINISHED)


def cmd_cancel(args) -> None:
    from results.client import Client

    with Client(args.url, api_key=args.api_key) as c:
        _print_json(c.cancel(args.id))


def cmd_keys(args) -> None:
    """Operator commands: straight to Redis, no API."""
    conn = redis_url.connect(args.redis_url)
    if args.keys_cmd == "create":
        limits = {name: getattr(args, name) for name in tenants.LIMITS if getattr(args, name) is not None}
        key, tenant = tenants.create(conn, args.name, limits, args.high_priority, args.admin)
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

    from worker.engine import Engine, freeze_gc
    from worker.publish import sample_record

    spec = job_spec(job_body(args.input, args), args.input)  # the job a worker would run
    engine = Engine(args.model, engine_config(args))
    freeze_gc()
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
    batchfile.write_results(({"index": i, "custom_id": spec.custom_id(i),
                              "samples": [{"sample": j, **s} for j, s in sorted(samples[i].items())]}
                             for i in range(len(items))), args.output)
    dt = time.monotonic() - t0
    print(f"{len(items)} items, {tokens} tokens in {dt:.1f}s ({_rate(tokens, dt)} tok/s) "
          f"-> {args.output}", file=sys.stderr)


def _rate(tokens: int, seconds: float) -> str:
    """Tokens per second to three figures: a slow run reads 0.25, not 0."""
    return f"{tokens / max(seconds, 1e-9):.3g}"
