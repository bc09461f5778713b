"""A small job beside a huge one: its latency on idle workers and on the same workers while
they run a 640,000-sample job, side by side in one run.

    python bench/beside.py                   # the tests' tiny model, 2 workers, 1 thread each
    python bench/beside.py --repeats 8 --settle 60

The small job: 4 prompts, 16 new tokens each, temperature 0.8 (what an interactive user or
an online request sends). The huge job: {"prompts": ["x"] * 10000, n: 64, max_new_tokens:
4096, ignore_eos}, 640,000 samples that fill both engines' slots for the whole run. Each
figure is POST /v1/jobs to the job's terminal status (`succeeded`), polled every 20 ms; the
small job runs --repeats times idle, then the huge job starts and, once both engines are
full (and again --settle seconds later, when its samples are longer), --repeats times
beside it. Ratio: the median beside / the median idle (target <= 2). Results: stdout and
bench/out/beside.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import httpx  # noqa: E402
import redis  # noqa: E402

from service import prompts, spawn, wait  # noqa: E402

from results import events, keys  # noqa: E402
from cli.redis_server import EmbeddedRedis, free_port  # noqa: E402
from bench.out_file import save  # noqa: E402

SMALL = {"max_new_tokens": 16, "temperature": 0.8}
HUGE = {"prompts": ["x"] * 10_000, "sampling_params": {"n": 64, "max_new_tokens": 4096, "ignore_eos": True}}


def small_job(http, conn, seed: int, stages: list) -> float:
    """POST to `succeeded`, in seconds; appends to `stages` when (from the POST, by the
    stream entries' Redis clock) its shard was taken, its first token out, its last."""
    body = {"prompts": prompts(4, seed=seed), "sampling_params": SMALL, "seed": seed}
    posted = time.time()
    t = time.perf_counter()
    job = http.post("/v1/jobs", json=body).json()["id"]
    while (status := http.get(f"/v1/jobs/{job}").json()["status"]) not in events.TERMINAL:
        time.sleep(0.02)
    took = time.perf_counter() - t
    if status != "succeeded":
        raise RuntimeError(f"the small job {job} ended {status}")
    at: dict = {}
    for entry_id, fields in conn.xrange(keys.stream(job)):
        kind = events.decode(fields)["type"]
        ms = int(entry_id.split("-")[0]) / 1000 - posted
        at.setdefault({events.ATTEMPT: "taken", events.DELTA: "first"}.get(kind, kind), ms)
        if kind == events.FINAL:
            at["last"] = ms
    stages.append({k: at.get(k) for k in ("taken", "first", "last")})
    return took


def stage_medians(stages: list[dict]) -> str:
    return ", ".join(f"{k} {statistics.median(s[k] for s in stages):.3f}s" for k in ("taken", "first", "last"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--settle", type=float, default=30.0, help="seconds between the two rounds beside")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--logs", default=None, help="a folder for the processes' logs (default: none kept)")
    args = ap.parse_args()

    from worker.engine.models.tiny import build_tiny_model
    model = build_tiny_model(os.path.join(tempfile.mkdtemp(), "llama"), arch="llama", max_context=8192)
    server = EmbeddedRedis()
    env = {**os.environ, "REDIS_URL": server.url, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    port = free_port()
    procs = [spawn(["api", "--port", str(port)], env, log=args.logs and f"{args.logs}/api.log")]
    names = [f"bench-beside-{os.getpid()}-{k}" for k in range(args.workers)]
    procs += [spawn(["worker", "--model", model, "--device", "cpu", "--name", n, "--served-model-name", "llama"],
                    env, log=args.logs and f"{args.logs}/{n}.log") for n in names]
    conn = redis.Redis.from_url(server.url, decode_responses=True)
    out: dict = {"small": {"items": 4, **SMALL}, "huge": HUGE["sampling_params"] | {"prompts": 10_000}}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            def api_up():
                try:
                    return http.get("/healthz").status_code == 200
                except httpx.TransportError:
                    return False
            wait(api_up, 60, "API start")
            wait(lambda: all(conn.hget(f"rq:worker:{n}", "state") == "idle" for n in names), 300, "workers")
            small_job(http, conn, 0, [])  # warm up
            idle_stages: list = []
            idle = [small_job(http, conn, 1 + k, idle_stages) for k in range(args.repeats)]
            print(f"idle    {' '.join(f'{s:.2f}' for s in idle)}  median {statistics.median(idle):.2f}s; "
                  f"{stage_medians(idle_stages)}", flush=True)

            huge = http.post("/v1/jobs", json=HUGE).json()["id"]
            wait(lambda: len(http.get(f"/v1/jobs/{huge}").json()["shards"]["workers"]) == args.workers,
                 120, "every worker to take the huge job's shards")
            time.sleep(5)  # their samples admitted and decoding
            rounds = {}
            for name, pause in (("beside", 0.0), ("beside_later", args.settle)):
                time.sleep(pause)
                stages: list = []
                times = [small_job(http, conn, 100 + k, stages) for k in range(args.repeats)]
                prog = http.get(f"/v1/jobs/{huge}").json()["progress"]
                rounds[name] = {"seconds": times, "median": statistics.median(times), "stages": stages,
                                "huge_samples_done": prog["samples_done"]}
                print(f"{name:<13} {' '.join(f'{s:.2f}' for s in times)}  median {statistics.median(times):.2f}s; "
                      f"{stage_medians(stages)} (huge job: {prog['samples_done']} samples done)", flush=True)
            http.post(f"/v1/jobs/{huge}/cancel")
            wait(lambda: http.get(f"/v1/jobs/{huge}").json()["status"] in events.TERMINAL, 60, "the cancel")
        out["idle"] = {"seconds": idle, "median": statistics.median(idle), "stages": idle_stages}
        out.update(rounds)
        out["ratio"] = {k: rounds[k]["median"] / out["idle"]["median"] for k in rounds}
        print("ratio beside / idle: " + ", ".join(f"{k} {v:.2f}" for k, v in out["ratio"].items()))
        print(f"wrote {save('beside', out)}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        conn.close()
        server.stop()


if __name__ == "__main__":
    main()
