"""The whole service vs the engine in-process, on the same workload, in one run.

    python bench/service.py                      # bench/engine.py's toy model
    python bench/service.py --model PATH --device cuda

1. engine: 64 prompts through `Engine.generate` in this process.
2. service: the same 64 prompts as one job through HTTP submit, rq, the worker process and
   the SSE stream; throughput from POST to the terminal status. Must keep >= 90% of (1).
   The two engines (here and in the worker) get the same KV pool and warm up on the same
   other prompts; then they alternate on --repeats fresh prompt sets (no prefix cache hits
   across runs) and the best run of each counts, so load from other processes on the
   machine hits both sides alike.
3. latency: POST to the first delta on the stream, a 1-prompt job on an idle worker (median).
4. intake: jobs per second the API accepts (POSTs from --concurrency threads, worker stopped).
Redis is REDIS_URL if set, else an embedded server. Results: stdout and bench/out/service.json.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import httpx  # noqa: E402
import redis  # noqa: E402

from results.client import Client  # noqa: E402
from cli.redis_server import EmbeddedRedis, free_port  # noqa: E402
from bench.out_file import save  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from his her an which or be are this "
         "data model token batch queue worker stream result prompt sample seed cache kernel page").split()


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(8, 96))) for _ in range(n)]


def best(runs: list[dict]) -> dict:
    top = min(runs, key=lambda r: r["seconds"])
    return {**top, "tok_s": top["tokens"] / top["seconds"], "runs_s": [r["seconds"] for r in runs]}


def run_engine(engine, work, sp) -> dict:
    from worker.engine import SamplingParams
    t = time.perf_counter()
    items = engine.generate(prompts=work, sampling_params=SamplingParams(**sp))
    return {"seconds": time.perf_counter() - t,
            "tokens": sum(len(s.token_ids) for it in items for s in it.samples)}


def spawn(args: list[str], env: dict, log: str | None = None) -> subprocess.Popen:
    """`fanout ARGS` as a process; its output to the file `log`, or nowhere."""
    out = open(log, "ab") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "cli.main", *args], env=env, cwd=ROOT,
                            stdout=out, stderr=subprocess.STDOUT)


def wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def run_job(client: Client, body: dict) -> dict:
    """Submit, follow SSE to the end; POST -> first delta and POST -> end times."""
    t0 = time.perf_counter()
    job = client.submit(body)
    first = None
    for _, e in client.events(job["id"]):
        if first is None and e["type"] == "delta":
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    info = client.status(job["id"])
    assert info["status"] == "succeeded", info
    return {"first_delta": first, "seconds": total, "tokens": info["usage"]["completion_tokens"]}


def bench_intake(url: str, n: int, concurrency: int) -> dict:
    later = (datetime.now(timezone.utc) + timedelta(days=1)).isoformat()
    body = {"prompts": ["a short prompt"], "sampling_params": {"max_new_tokens": 16}, "run_at": later}
    with httpx.Client(base_url=url, timeout=30, limits=httpx.Limits(max_connections=concurrency)) as http:
        def post(_):
            r = http.post("/v1/jobs", json=body)
            r.raise_for_status()
            return r.json()["id"]
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(post, range(min(n, 20))))  # warm connections
            t = time.perf_counter()
            ids = list(pool.map(post, range(n)))
            dt = time.perf_counter() - t
            list(pool.map(lambda i: http.post(f"/v1/jobs/{i}/cancel"), ids))  # leave nothing scheduled
    return {"jobs": n, "seconds": dt, "jobs_s": n / dt, "concurrency": concurrency}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: bench/engine.py's toy model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--api-workers", type=int, default=2)
    ap.add_argument("--post-jobs", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--latency-runs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-tokens", type=int, default=131072, help="KV pool of each engine (the same)")
    ap.add_argument("--delta-interval", type=float, default=0.1, help="the worker's stream granularity")
    args = ap.parse_args()

    if args.model is None:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        from engine import toy_model
        args.model = toy_model(os.path.join(ROOT, "bench", "out", "model"))
    warm = prompts(args.prompts, seed=1)
    works = [prompts(args.prompts, seed=10 + k) for k in range(args.repeats)]
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}

    server = None if os.environ.get("REDIS_URL") else EmbeddedRedis()
    redis_url = os.environ.get("REDIS_URL") or server.url
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": ROOT}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    api = spawn(["api", "--port", str(port), "--workers", str(args.api_workers)], env)
    name = f"bench-{os.getpid()}"
    worker = spawn(["worker", "--model", args.model, "--device", args.device, "--name", name,
                    "--kv-tokens", str(args.kv_tokens), "--delta-interval", str(args.delta_interval)], env)
    conn = redis.Redis.from_url(redis_url)
    try:
        from worker.engine import Engine
        engine = Engine(args.model, device=args.device, kv_tokens=args.kv_tokens)

        def api_up():
            try:
                return httpx.get(url + "/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False
        wait(api_up, 60, "API start")
        wait(lambda: conn.hget(f"rq:worker:{name}", "state") == b"idle", 300, "worker start")
        with Client(url) as client:
            warm_sp = {**sp, "max_new_tokens": 8}
            run_engine(engine, warm, warm_sp)
            run_job(client, {"prompts": warm, "sampling_params": warm_sp})
            # Alternate, so drifts in machine load hit both sides alike.
            e_runs, s_runs = [], []
            for work in works:
                e_runs.append(run_engine(engine, work, sp))
                s_runs.append(run_job(client, {"prompts": work, "sampling_params": sp}))
            eng, service = best(e_runs), best(s_runs)
            pairs = [e["seconds"] / s_["seconds"] for e, s_ in zip(e_runs, s_runs)]
            print(f"engine   {eng['tokens']} tokens in {eng['seconds']:.2f}s = {eng['tok_s']:.0f} tok/s", flush=True)
            print(f"service  {service['tokens']} tokens in {service['seconds']:.2f}s = {service['tok_s']:.0f} "
                  f"tok/s ({service['tok_s'] / eng['tok_s']:.1%} of the engine; per-run ratios "
                  f"{', '.join(f'{p:.0%}' for p in pairs)})", flush=True)
            lat = [run_job(client, {"prompts": [f"{k} {warm[k]}"], "sampling_params": {**sp, "max_new_tokens": 4}})
                   ["first_delta"] for k in range(args.latency_runs)]
            latency = {"median_s": statistics.median(lat), "runs": lat,
                       "in_64_prompt_job_s": service["first_delta"]}
            print(f"latency  POST -> first delta: {latency['median_s'] * 1000:.0f} ms median on an idle "
                  f"worker, {service['first_delta'] * 1000:.0f} ms in the 64-prompt job", flush=True)
        worker.terminate()
        worker.wait(60)
        intake = bench_intake(url, args.post_jobs, args.concurrency)
        print(f"intake   {intake['jobs_s']:.0f} jobs/s accepted ({args.api_workers} API processes, "
              f"{args.concurrency} concurrent clients)", flush=True)
    finally:
        for p in (worker, api):
            if p.poll() is None:
                p.terminate()
                p.wait(60)
        conn.close()
        if server:
            server.stop()
    ratio = service["tok_s"] / eng["tok_s"]
    out = {"model": args.model, "device": args.device, "prompts": args.prompts,
           "delta_interval": args.delta_interval,
           "max_new_tokens": args.max_new_tokens, "engine": eng, "service": service,
           "service_over_engine": ratio, "per_run_ratios": pairs, "latency": latency, "intake": intake}
    save("service", out)
    print(f"service keeps {ratio:.1%} of the engine's throughput (target >= 90%)")


if __name__ == "__main__":
    main()
