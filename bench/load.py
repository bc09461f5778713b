"""Load: many small jobs from many clients at once, through the whole service.

    python bench/load.py                       # 1,000 jobs, 50 clients, bench/engine.py's toy model
    python bench/load.py --jobs 5000 --clients 200 --api-workers 4

Each client thread POSTs its share of the jobs (1-3 prompts, a few tokens each) as fast as
the API answers, then every job is followed to its end. Counted: accepted (202), refused
(anything else), lost (accepted but not `succeeded` by the deadline), duplicated (a sample
with more than one `final` entry in its stream, or stored results that disagree with the
stream); API latency p50/p99 of POST /v1/jobs under that load and of GET /v1/jobs/{id}
afterwards. Redis is REDIS_URL if set, else an embedded server. Results: stdout and
bench/out/load.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import httpx  # noqa: E402
import redis  # noqa: E402

from results import reader  # noqa: E402
from service import prompts, spawn, wait  # noqa: E402  (bench/service.py)
from cli.redis_server import EmbeddedRedis, free_port  # noqa: E402
from bench.out_file import save  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: bench/engine.py's toy model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--api-workers", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=600, help="seconds for every job to end")
    args = ap.parse_args()
    if args.model is None:
        from engine import toy_model  # bench/engine.py
        args.model = toy_model(os.path.join(ROOT, "bench", "out", "model"))

    rng = random.Random(0)
    bodies = [{"prompts": prompts(rng.randrange(1, 4), seed=i),
               "sampling_params": {"max_new_tokens": rng.randrange(2, 9), "n": rng.choice([1, 2])},
               "seed": i} for i in range(args.jobs)]
    server = None if os.environ.get("REDIS_URL") else EmbeddedRedis()
    redis_url = os.environ.get("REDIS_URL") or server.url
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": ROOT}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    api = spawn(["api", "--port", str(port), "--workers", str(args.api_workers)], env)
    name = f"load-{os.getpid()}"
    worker = spawn(["worker", "--model", args.model, "--device", args.device, "--name", name], env)
    conn = redis.Redis.from_url(redis_url)
    try:
        def api_up():
            try:
                return httpx.get(url + "/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False
        wait(api_up, 60, "API start")
        wait(lambda: conn.hget(f"rq:worker:{name}", "state") == b"idle", 300, "worker start")
        limits = httpx.Limits(max_connections=args.clients)
        with httpx.Client(base_url=url, timeout=60, limits=limits) as http:
            def post(body):
                t = time.perf_counter()
                try:
                    r = http.post("/v1/jobs", json=body)
                except httpx.HTTPError as e:
                    return None, type(e).__name__, time.perf_counter() - t
                job = r.json().get("id") if r.status_code == 202 else None
                return job, r.status_code, time.perf_counter() - t

            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                posted = list(pool.map(post, bodies))
            submit_s = time.perf_counter() - t0
            ids = [(job, body) for (job, _, _), body in zip(posted, bodies) if job]
            codes = Counter(code for _, code, _ in posted)

            def end(job_body):
                job, body = job_body
                entries = list(reader.follow(conn, job, timeout=max(1.0, args.deadline - (time.perf_counter() - t0))))
                finals = Counter((e["index"], e["sample"]) for _, e in entries if e["type"] in ("final", "error"))
                t = time.perf_counter()
                info = http.get(f"/v1/jobs/{job}").json()
                get_s = time.perf_counter() - t
                results = http.get(f"/v1/jobs/{job}/results").json()["items"]
                want = len(body["prompts"]) * body["sampling_params"]["n"]
                stored = {(it["index"], s["sample"]): s["token_ids"] for it in results for s in it["samples"]}
                rebuilt = reader.Rebuilder()
                for _, e in entries:
                    rebuilt.apply(e)
                agree = all(rebuilt.outputs[k].token_ids == v for k, v in stored.items())
                return {"status": info["status"], "dup": sum(c - 1 for c in finals.values()),
                        "missing": want - len(stored), "agree": agree, "get_s": get_s}

            with ThreadPoolExecutor(args.clients) as pool:
                try:
                    ended = list(pool.map(end, ids))
                except TimeoutError:
                    ended = None
            all_s = time.perf_counter() - t0
    finally:
        for p in (worker, api):
            if p.poll() is None:
                p.terminate()
                p.wait(60)
        conn.close()
        if server:
            server.stop()
    post_lat = [s for _, _, s in posted]
    out = {"jobs": args.jobs, "clients": args.clients, "api_workers": args.api_workers,
           "accepted": codes.get(202, 0), "refused": {str(k): v for k, v in codes.items() if k != 202},
           "submit_s": submit_s, "post_p50_ms": pct(post_lat, 0.5) * 1000, "post_p99_ms": pct(post_lat, 0.99) * 1000}
    if ended is None:
        out["lost"] = "deadline passed before every job ended"
    else:
        get_lat = [e["get_s"] for e in ended]
        out.update({"succeeded": sum(e["status"] == "succeeded" for e in ended),
                    "lost": sum(e["status"] != "succeeded" or e["missing"] > 0 for e in ended),
                    "duplicated": sum(e["dup"] for e in ended),
                    "stream_disagrees": sum(not e["agree"] for e in ended),
                    "all_done_s": all_s,
                    "get_p50_ms": pct(get_lat, 0.5) * 1000, "get_p99_ms": pct(get_lat, 0.99) * 1000})
    print(json.dumps(out, indent=2))
    save("load", out)


if __name__ == "__main__":
    main()
