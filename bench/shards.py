"""One job on every worker: what shards buy a user with several workers, in one run.

    python bench/shards.py                  # the tests' tiny model, 2 workers, 1 thread each

1. scaling: one job of --items items vs the same items as 2 jobs (what a user did by hand
   before shards), alternated --repeats times; wall time from the POSTs to the last
   terminal status. Ratio one job / two jobs (target <= 1.2), and each worker's share of
   the one job's samples (from the stream's attempt entries; target >= 30% each). The
   same through the OpenAI batch routes (files + batches).
2. outputs: the one job's samples (temperature 0.8, job seed) against the engine's in this
   process: equal token for token whatever worker ran what.
3. fairness: a 10-item job submitted behind a --huge-item job of the same priority: POST to
   its first result and to its end, in shard-times (the mean time a shard of the
   scaling job took). Then the same small job when both engines are full of long samples
   (items of n=64, 4096 new tokens, ignore_eos: the engines' slots all taken): POST to
   its end, and how many of the long job's samples had ended by then (0: it did not wait
   for a slot to free).
4. intake: POST to the first result of a 100-item job and of a 10,000-item job on idle
   workers, and each worker's RSS growth over the big one.
Redis is an embedded server. Results: stdout and bench/out/shards.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import httpx  # noqa: E402
import redis  # noqa: E402

from service import prompts, spawn, wait  # noqa: E402

from results import events, keys  # noqa: E402
from cli.redis_server import EmbeddedRedis, free_port  # noqa: E402
from bench.out_file import save  # noqa: E402


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def entries(conn, job_id: str) -> list[dict]:
    return [events.decode(f) for _, f in conn.xrange(keys.stream(job_id))]


def ended(http, job_id: str) -> bool:
    return http.get(f"/v1/jobs/{job_id}").json()["status"] in events.TERMINAL


def run_jobs(http, bodies: list[dict]) -> tuple[float, list[str]]:
    t = time.perf_counter()
    ids = [http.post("/v1/jobs", json=b).json()["id"] for b in bodies]
    wait(lambda: all(ended(http, i) for i in ids), 1800, "the jobs")
    return time.perf_counter() - t, ids


def run_batches(http, files: list[bytes]) -> float:
    t = time.perf_counter()
    ids = []
    for data in files:
        f = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", data)}).json()
        ids.append(http.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                                  "completion_window": "24h"}).json()["id"])
    wait(lambda: all(http.get(f"/v1/batches/{i}").json()["status"] in ("completed", "failed", "cancelled")
                     for i in ids), 1800, "the batches")
    return time.perf_counter() - t


def batch_file(items: list[str], max_tokens: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "llama", "prompt": p, "max_tokens": max_tokens}}) + "\n"
                   for i, p in enumerate(items)).encode()


def first_result(conn, http, body: dict, posted: list | None = None) -> tuple[float, str]:
    """POST -> the first delta or final on the stream (`posted` gets POST -> 202). The body
    is encoded before the clock starts: a client's JSON encoding is not the service's time."""
    raw = json.dumps(body).encode()
    t = time.perf_counter()
    job_id = http.post("/v1/jobs", content=raw, headers={"content-type": "application/json"}).json()["id"]
    if posted is not None:
        posted.append(time.perf_counter() - t)
    last = "0"
    while True:
        resp = conn.xread({keys.stream(job_id): last}, block=1000)
        for _, es in resp or []:
            for entry_id, fields in es:
                last = entry_id
                if events.decode(fields)["type"] in (events.DELTA, events.FINAL):
                    return time.perf_counter() - t, job_id


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=1200)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--huge-items", type=int, default=100_000)
    args = ap.parse_args()

    from worker.engine.models.tiny import build_tiny_model
    model = build_tiny_model(os.path.join(tempfile.mkdtemp(), "llama"), arch="llama")
    server = EmbeddedRedis()
    env = {**os.environ, "REDIS_URL": server.url, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    port = free_port()
    api = spawn(["api", "--port", str(port)], env)
    names = [f"bench-shards-{os.getpid()}-{k}" for k in range(2)]
    workers = [spawn(["worker", "--model", model, "--device", "cpu", "--name", n,
                      "--served-model-name", "llama"], env) for n in names]
    conn = redis.Redis.from_url(server.url, decode_responses=True)
    out: dict = {"items": args.items, "max_new_tokens": args.max_new_tokens}
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0.8, "ignore_eos": True}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            def api_up():
                try:
                    return http.get("/healthz").status_code == 200
                except httpx.TransportError:
                    return False
            wait(api_up, 60, "API start")
            wait(lambda: all(conn.hget(f"rq:worker:{n}", "state") == "idle" for n in names), 300, "workers")
            run_jobs(http, [{"prompts": prompts(64, seed=1), "sampling_params": sp}])  # warm up

            # 1. scaling
            one, two, shares, shard_times = [], [], [], []
            for r in range(args.repeats):
                work = prompts(args.items, seed=100 + r)
                half = args.items // 2
                s1, [job] = run_jobs(http, [{"prompts": work, "sampling_params": sp, "seed": 7}])
                s2, _ = run_jobs(http, [{"prompts": work[:half], "sampling_params": sp, "seed": 7},
                                        {"prompts": work[half:], "sampling_params": sp, "seed": 7}])
                one.append(s1)
                two.append(s2)
                ran = {e["shard"]: (e["worker"], e["hi"] - e["lo"]) for e in entries(conn, job)
                       if e["type"] == "attempt"}
                share = Counter()
                for w, n in ran.values():
                    share[w] += n
                shares.append({w: share[events.worker_ref(w)] / args.items for w in names})
                shard_times.append(s1 / len(ran) * 2)  # two workers run shards side by side
                print(f"scaling  run {r}: one job {s1:.2f}s, two jobs {s2:.2f}s, ratio {s1 / s2:.2f}; "
                      f"shares {', '.join(f'{v:.0%}' for v in shares[-1].values())}", flush=True)
            ratios = [a / b for a, b in zip(one, two)]
            out["scaling"] = {"one_job_s": one, "two_jobs_s": two, "ratios": ratios,
                              "median_ratio": statistics.median(ratios), "shares": shares}

            # ... and through the OpenAI batch routes
            b_ratios = []
            for r in range(args.repeats):
                work = prompts(args.items, seed=200 + r)
                half = args.items // 2
                b1 = run_batches(http, [batch_file(work, args.max_new_tokens)])
                b2 = run_batches(http, [batch_file(work[:half], args.max_new_tokens),
                                        batch_file(work[half:], args.max_new_tokens)])
                b_ratios.append(b1 / b2)
                print(f"batches  run {r}: one batch {b1:.2f}s, two batches {b2:.2f}s, ratio {b1 / b2:.2f}",
                      flush=True)
            out["batches"] = {"ratios": b_ratios, "median_ratio": statistics.median(b_ratios)}

            # 2. outputs against the engine in this process
            from worker.engine import Engine, SamplingParams
            engine = Engine(model, device="cpu")
            work = prompts(args.items, seed=100)
            ref = engine.generate(prompts=work, sampling_params=SamplingParams(**sp), seed=7)
            _, [job] = run_jobs(http, [{"prompts": work, "sampling_params": sp, "seed": 7}])
            got = {}
            offset = 0
            while offset is not None:
                page = http.get(f"/v1/jobs/{job}/results", params={"offset": offset, "limit": 1000}).json()
                got.update({it["index"]: it["samples"][0]["token_ids"] for it in page["items"]})
                offset = page["next_offset"]
            equal = sum(got[i] == it.samples[0].token_ids for i, it in enumerate(ref))
            out["outputs_equal"] = f"{equal}/{len(ref)}"
            print(f"outputs  {equal}/{len(ref)} items equal to the engine's in this process", flush=True)

            # 3. fairness
            shard_s = statistics.median(shard_times)
            huge = http.post("/v1/jobs", json={"prompts": [f"bulk item {i}" for i in range(args.huge_items)],
                                               "sampling_params": sp}).json()["id"]
            wait(lambda: http.get(f"/v1/jobs/{huge}").json()["status"] == "running", 120, "the huge job")
            t = time.perf_counter()
            first, small = first_result(conn, http, {"prompts": prompts(10, seed=4), "sampling_params": sp})
            wait(lambda: ended(http, small), 600, "the small job")
            small_s = time.perf_counter() - t
            big = http.get(f"/v1/jobs/{huge}").json()
            http.post(f"/v1/jobs/{huge}/cancel")
            wait(lambda: ended(http, huge), 60, "the cancel")
            out["fairness"] = {"huge_items": args.huge_items, "first_result_s": first, "done_s": small_s,
                               "shard_s": shard_s, "huge_done_items_then": big["progress"]["done"]}
            print(f"fairness 10 items behind {args.huge_items}: first result {first:.2f}s, done {small_s:.2f}s "
                  f"({small_s / shard_s:.1f} shard-times of {shard_s:.2f}s); the huge job had "
                  f"{big['progress']['done']} items done", flush=True)
            long = http.post("/v1/jobs", json={"prompts": [f"long item {i}" for i in range(1000)], "sampling_params": {
                "n": 64, "max_new_tokens": 4096, "ignore_eos": True}}).json()["id"]
            wait(lambda: len(http.get(f"/v1/jobs/{long}").json()["shards"]["workers"]) == 2, 120, "the long job")
            time.sleep(2)  # every slot taken
            t = time.perf_counter()
            first, small = first_result(conn, http, {"prompts": prompts(10, seed=4), "sampling_params": sp})
            wait(lambda: ended(http, small), 600, "the small job")
            beside_s = time.perf_counter() - t
            ended_then = http.get(f"/v1/jobs/{long}").json()["progress"]["samples_done"]
            http.post(f"/v1/jobs/{long}/cancel")
            wait(lambda: ended(http, long), 60, "the cancel")
            out["fairness"].update(beside_full_first_s=first, beside_full_done_s=beside_s,
                                   long_samples_ended_then=ended_then)
            print(f"fairness 10 items beside full engines of 4096-token samples: first result {first:.2f}s, "
                  f"done {beside_s:.2f}s; {ended_then} of the long job's samples had ended", flush=True)

            # 4. intake, alternated: 100 items, 10,000 items, 100, ...
            ttfr: dict = {100: [], 10_000: []}
            for r in range(args.repeats):
                for n in (100, 10_000):
                    before = [rss_mb(w.pid) for w in workers]
                    peak = list(before)
                    posted: list[float] = []
                    body = {"prompts": prompts(n, seed=5 + n + r), "sampling_params": sp}
                    first, job = first_result(conn, http, body, posted)
                    while not ended(http, job):
                        peak = [max(p, rss_mb(w.pid)) for p, w in zip(peak, workers)]
                        time.sleep(0.2)
                    ttfr[n].append({"first_result_s": first, "post_s": posted[0],
                                    "rss_growth_mb": [p - b for p, b in zip(peak, before)]})
                    print(f"intake   run {r}, {n} items: first result {first * 1000:.0f} ms (of which POST "
                          f"-> 202 {posted[0] * 1000:.0f} ms); worker RSS growth "
                          f"{', '.join(f'{g:.0f}' for g in ttfr[n][-1]['rss_growth_mb'])} MB", flush=True)
            ratios = [b["first_result_s"] / a["first_result_s"] for a, b in zip(ttfr[100], ttfr[10_000])]
            out["intake"] = {**ttfr, "ratios": ratios, "median_ratio": statistics.median(ratios)}
            print(f"intake   first result 10,000 / 100 items: {', '.join(f'{x:.2f}' for x in ratios)} "
                  "(target <= 2)", flush=True)
    finally:
        for p in (*workers, api):
            if p.poll() is None:
                p.terminate()
                p.wait(60)
        conn.close()
        server.stop()
    save("shards", out)
    print(f"one job / two jobs: {out['scaling']['median_ratio']:.2f} (target <= 1.2); batches "
          f"{out['batches']['median_ratio']:.2f}")


if __name__ == "__main__":
    main()
