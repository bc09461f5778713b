"""A native dataset job at two sizes, side by side in one run: does the service stay flat as
the dataset grows? For each size: a Redis, two workers and an API process of their own, the
same tiny random-weight model (built offline), a JSONL file of that many rows (a short
prompt and a custom id each, 2 new tokens, greedy), uploaded (POST /v1/files, purpose
dataset) and run (POST /v1/jobs with input_file_id). Mid-run one worker is killed with
SIGKILL and started again (at a third of the rows), then the API process (at two thirds).
Then every row is checked through GET /results, a page at a time: answered exactly once,
in order, with its custom id (`wrong` lists what is not, [] when all is), and the whole
output is read as one file, GET /output in JSONL and in Parquet (timed to its last byte,
then checked the same way: `output_jsonl_rows_per_s`, `output_parquet_rows_per_s`).

    python bench/datasets.py                          # 20,000, 1,000,000, then 20,000 rows again
    python bench/datasets.py --rows 20000,200000 --no-kill

Reported per size: Redis's used_memory peak (sampled every 0.2 s, less the empty
service's), the API's and the workers' peak RSS (VmHWM, the most of any of their
processes), rows/s over the run (from the job's creation to its end, its validation
included: validate_s) and steady rows/s (the median over 10 s windows, which leaves the
kills out), the seconds of each step.
The sizes run in turn, and a shared machine's speed drifts by 10-15% over minutes (a plain
matmul loop here: 479-667 per second in 10 s windows), so a size may run twice, before and
after the others: each larger size's figures are then given as ratios to the mean of the
smallest size's runs (`vs_smallest`). Results: stdout and bench/out/datasets.json.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import httpx  # noqa: E402
import redis as redis_lib  # noqa: E402

from bench.out_file import save  # noqa: E402
from worker.engine.models.tiny import build_tiny_model  # noqa: E402
from cli.redis_server import EmbeddedRedis, free_port  # noqa: E402

ME = [sys.executable, "-m", "cli.main"]
TOKENS = 2


def dataset(path: str, rows: int) -> None:
    """Rows of one length in tokens whatever the size (the index zero-padded): the sizes
    compare the service, not longer prompts."""
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"prompt": f"row {i:07d}: say something about the number {i:07d}",
                                "custom_id": f"r{i}"}) + "\n")


def hwm_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return 0.0


class Service:
    """Redis, the API and two workers, each restartable; `peaks` sampled in a thread."""

    def __init__(self, model: str, work: str):
        self.redis_server = EmbeddedRedis()
        # One torch thread per worker (as bench/shards.py): two workers of a thread per core
        # each would make four threads contend for the two cores.
        self.env = {**os.environ, "REDIS_URL": self.redis_server.url, "PYTHONPATH": ROOT,
                    "FANOUT_STORAGE_URL": f"file://{work}/blobs", "FANOUT_HEARTBEAT_TTL": "5",
                    "OMP_NUM_THREADS": "1"}
        self.model, self.port = model, free_port()
        self.logs = open(os.path.join(work, "service.log"), "ab")
        self.r = redis_lib.Redis.from_url(self.redis_server.url)
        self.url = f"http://127.0.0.1:{self.port}"
        self.api = self._start(["api", "--port", str(self.port)])
        self.workers = [self._worker() for _ in range(2)]
        self.peak = {"redis": 0.0, "api": 0.0, "worker": 0.0}
        self.base = 0.0
        self.done_at: list[tuple[float, int]] = []  # (time, rows done)
        self.job_id: str | None = None
        self.validated_at: float | None = None  # when the job left `validating`
        self.stopping = False

    def _start(self, args: list[str]) -> subprocess.Popen:
        return subprocess.Popen(ME + args, cwd=ROOT, env=self.env, stdout=self.logs, stderr=subprocess.STDOUT)

    def _worker(self) -> subprocess.Popen:
        return self._start(["worker", "--model", self.model, "--device", "cpu", "--drain-timeout", "0"])

    def ready(self, http: httpx.Client, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if http.get("/v1/models").json().get("data") and self.r.scard("rq:workers") >= 2:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the service did not start: see service.log"
            time.sleep(0.2)

    def sample(self) -> None:
        while not self.stopping:
            try:
                self.peak["redis"] = max(self.peak["redis"], self.r.info("memory")["used_memory"] / 2**20 - self.base)
                if self.job_id:
                    state, done = self.r.hmget(f"fanout:job:{self.job_id}", "state", "done")
                    if self.validated_at is None and state not in (None, b"validating"):
                        self.validated_at = time.monotonic()
                    self.done_at.append((time.monotonic(), int(done or 0)))
            except redis_lib.RedisError:
                pass
            self.peak["api"] = max(self.peak["api"], hwm_mb(self.api.pid))
            self.peak["worker"] = max([self.peak["worker"]] + [hwm_mb(w.pid) for w in self.workers])
            time.sleep(0.2)

    def kill_worker(self) -> None:
        self.workers[0].send_signal(signal.SIGKILL)
        self.workers[0].wait()
        self.workers[0] = self._worker()

    def kill_api(self) -> None:
        self.api.send_signal(signal.SIGKILL)
        self.api.wait()
        self.api = self._start(["api", "--port", str(self.port)])

    def close(self) -> None:
        self.stopping = True
        for p in [self.api, *self.workers]:
            p.terminate()
            p.wait(60)
        self.r.close()
        self.redis_server.stop()
        self.logs.close()


def steady(done_at: list[tuple[float, int]], window: float = 10.0) -> float:
    """The median rows/s over consecutive windows of `window` seconds."""
    rates, start = [], 0
    for i, (t, n) in enumerate(done_at):
        if t - done_at[start][0] >= window:
            rates.append((n - done_at[start][1]) / (t - done_at[start][0]))
            start = i
    return statistics.median(rates) if rates else 0.0


def check(http: httpx.Client, r, job_id: str, rows: int) -> list[str]:
    """Every row answered exactly once, in order, with its custom id, through GET /results a
    page at a time: what is wrong (the first 10), [] when nothing is."""
    wrong, offset, seen = [], 0, 0
    while offset is not None:
        page = http.get(f"/v1/jobs/{job_id}/results", params={"offset": offset, "limit": 1000}).json()
        for it in page["items"]:
            ok = (it["index"] == seen and it["custom_id"] == f"r{seen}" and len(it["samples"]) == 1
                  and it["samples"][0]["finish_reason"] in ("length", "stop"))
            if not ok and len(wrong) < 10:
                wrong.append(json.dumps(it)[:300])
            seen += 1
        offset = page["next_offset"]
    if seen != rows:
        wrong.append(f"{seen} rows read, not {rows}")
    stored = r.hmget(f"fanout:job:{job_id}", "samples_done", "done")
    if stored != [str(rows).encode()] * 2:  # each row's sample stored exactly once
        wrong.append(f"samples_done, done = {stored}")
    return wrong


def output(http: httpx.Client, job_id: str, rows: int, fmt: str) -> dict:
    """GET /output in `fmt`, timed to its last byte (the check after it is not timed): every
    row once, in order, with its custom id."""
    t = time.perf_counter()
    with http.stream("GET", f"/v1/jobs/{job_id}/output", params={"format": fmt}) as resp:
        resp.raise_for_status()
        body = b"".join(resp.iter_bytes())
    took = time.perf_counter() - t
    if fmt == "jsonl":
        ids = [json.loads(line)["custom_id"] for line in body.splitlines()]
    else:
        import io

        import pyarrow.parquet as pq
        ids = pq.read_table(io.BytesIO(body), columns=["custom_id"]).column("custom_id").to_pylist()
    wrong = [] if ids == [f"r{i}" for i in range(rows)] else [f"/output {fmt}: {len(ids)} rows, not each once in order"]
    return {"s": round(took, 2), "rows_per_s": round(rows / took), "mb": round(len(body) / 2**20, 1), "wrong": wrong}


def run(model: str, path: str, rows: int, work: str, kill: bool) -> dict:
    svc = Service(model, work)
    http = httpx.Client(base_url=svc.url, timeout=3600)
    try:
        svc.ready(http)
        svc.base = svc.r.info("memory")["used_memory"] / 2**20
        threading.Thread(target=svc.sample, daemon=True).start()
        out: dict = {"rows": rows, "file_mb": round(os.path.getsize(path) / 2**20, 1)}
        t = time.perf_counter()
        with open(path, "rb") as f:
            file_id = http.post("/v1/files", files={"file": ("rows.jsonl", f)}, data={"purpose": "dataset"}).json()["id"]
        out["upload_s"] = time.perf_counter() - t
        t = time.perf_counter()
        r = http.post("/v1/jobs", json={"input_file_id": file_id,
                                        "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0}})
        assert r.status_code == 202, r.text
        job_id = svc.job_id = r.json()["id"]
        out["create_s"] = time.perf_counter() - t
        t = time.perf_counter()
        started = time.monotonic()
        marks = [rows // 3, 2 * rows // 3] if kill else []
        while True:
            try:
                info = http.get(f"/v1/jobs/{job_id}").json()
            except httpx.TransportError:  # the API was just killed: its successor is starting
                time.sleep(0.5)
                continue
            if info["status"] in ("succeeded", "failed", "canceled"):
                break
            if marks and info["progress"]["done"] >= marks[0]:
                (svc.kill_worker if len(marks) == 2 else svc.kill_api)()
                marks.pop(0)
            time.sleep(0.5)
        out["run_s"] = time.perf_counter() - t
        assert info["status"] == "succeeded", info
        out["rows_per_s"] = rows / out["run_s"]
        out["validate_s"] = round((svc.validated_at or started) - started, 1)  # of run_s: before any row runs
        out["steady_rows_per_s"] = steady(svc.done_at)
        time.sleep(0.5)  # a last sample of the peaks
        out.update({f"{k}_peak_mb": round(v, 1) for k, v in svc.peak.items()})
        out["redis_after_mb"] = round(svc.r.info("memory")["used_memory"] / 2**20 - svc.base, 1)
        out["kills"] = "worker at 1/3, API at 2/3" if kill else "none"
        print(json.dumps(out, indent=1), flush=True)  # the figures, whatever the check below finds
        t = time.perf_counter()
        out["wrong"] = check(http, svc.r, job_id, rows)
        out["read_s"] = time.perf_counter() - t
        for fmt in ("jsonl", "parquet"):
            got = output(http, job_id, rows, fmt)
            out["wrong"] += got.pop("wrong")
            out.update({f"output_{fmt}_{k}": v for k, v in got.items()})
        out["api_peak_with_output_mb"] = round(svc.peak["api"], 1)  # its peak reading /output too
        return out
    finally:
        http.close()
        svc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="20000,1000000,20000", help="sizes, comma-separated, run in turn")
    ap.add_argument("--no-kill", action="store_true", help="no worker or API killed mid-run")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="fanout-bench-datasets-")
    model = build_tiny_model(os.path.join(work, "llama"), arch="llama")
    runs = []
    for i, rows in enumerate(int(x) for x in args.rows.split(",")):
        path = os.path.join(work, f"rows-{rows}.jsonl")
        dataset(path, rows)
        sub = os.path.join(work, f"{i}-{rows}")
        os.makedirs(sub)
        runs.append(run(model, path, rows, sub, not args.no_kill))
        os.unlink(path)
        print(json.dumps(runs[-1], indent=1), flush=True)
    figures = {"runs": runs, "vs_smallest": vs_smallest(runs)}
    print(json.dumps(figures["vs_smallest"], indent=1))
    print("->", save("datasets", figures))


RATIOS = ("redis_peak_mb", "api_peak_mb", "worker_peak_mb", "rows_per_s", "steady_rows_per_s")


def vs_smallest(runs: list[dict]) -> dict:
    """Each larger size's figures over the mean of the smallest size's runs."""
    small = min(r["rows"] for r in runs)
    base = {k: statistics.mean(r[k] for r in runs if r["rows"] == small) for k in RATIOS}
    return {str(r["rows"]): {k: round(r[k] / base[k], 2) if base[k] else None for k in RATIOS}
            for r in runs if r["rows"] != small}


if __name__ == "__main__":
    main()
