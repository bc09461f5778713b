"""The coordinator's ceiling: how many GPU-rate workers one Redis carries.

    python bench/fleet_sim.py                              # 2 workers, 256 sequences at 30 steps/s
    python bench/fleet_sim.py --workers 4 --batch 64 --steps 30 --seconds 20

K real worker loops (worker/consumer.py: admission, claims, the publisher's transactions,
heartbeats, reaping, settles: the whole Redis protocol), each a process with its own
connections, on a simulated engine instead of a model: it runs `--batch` sequences at
`--steps` steps a second, one token per sequence per step, so a worker makes samples at a
GPU's rate with no GPU. Jobs are submitted as the API submits them (api.jobs.submit), enough
to keep every worker busy. Over `--seconds` after a warm-up the run reads from Redis's INFO
its CPU time (user + sys), the commands it ran and the bytes it took in, and counts the
samples stored and the shards ended (each one claim); per 1,000 samples, and shards a
second. By default nobody follows the jobs' streams (a batch: finals only); `--followed`
marks every stream followed, as online requests and watched jobs are (then deltas every
0.1 s per sample too, which every job sent before workers could tell).

From those: the workers one Redis carries at the GPU rate before its one core is busy
(`saturating_workers`: 1 CPU-second per second over the Redis CPU one worker's samples cost)
and at half of it (`workers_at_half_cpu`). A worker process here may fall short of the
simulated rate (Python on a shared core): the figures are per sample, and `steps_per_s`
says what the workers kept up. Results: stdout and bench/out/fleet_sim.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = "sim"  # the served name the simulated workers announce


@dataclass(slots=True)
class _Seq:
    tag: object
    index: int
    sample: int
    left: int  # tokens still to make
    made: int = 0


class SimEngine:
    """The engine's interface to the worker (worker/engine/engine.py Engine) over no model:
    `batch` sequences at `steps` steps a second, each making one token per step (id 7, text
    "x ") until its max_new_tokens."""

    task = "generate"

    def __init__(self, batch: int, steps: float, tokenizer):
        self.batch, self.period, self.tokenizer = batch, 1.0 / steps, tokenizer
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.decode_tokens = 0
        self.next_step = time.monotonic()
        self.steps = 0

    def served(self) -> dict:
        return {"task": self.task, "images": [], "max_model_len": 4096, "tools": None}

    def adapters(self) -> list:
        return []

    def add(self, tag, items, sampling_params, seed=None, sink=None, owner=None, lora=None) -> int:
        for (index, _, _), p in zip(items, sampling_params):
            for sample in range(p.n):
                self.waiting.append(_Seq(tag, index, sample, p.max_new_tokens))
        return len(items)

    def abort(self, tag) -> int:
        gone = [s for s in list(self.waiting) + self.running if s.tag == tag]
        self.waiting = deque(s for s in self.waiting if s.tag != tag)
        self.running = [s for s in self.running if s.tag != tag]
        return len(gone)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_room(self) -> bool:
        return len(self.running) + len(self.waiting) < self.batch

    def has_room_for_owner(self) -> bool:
        return False

    def stats(self):
        from worker.engine.engine import EngineStats
        return EngineStats(0, self.decode_tokens, 0, 0, len(self.running), len(self.waiting), 1, 1, 0)

    def step(self) -> list:
        from worker.engine.events import Event, Usage
        wait = self.next_step - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self.next_step = max(self.next_step + self.period, time.monotonic() - self.period)
        self.steps += 1
        while self.waiting and len(self.running) < self.batch:
            self.running.append(self.waiting.popleft())
        events, still = [], []
        for s in self.running:
            s.made += 1
            s.left -= 1
            if s.left > 0:
                events.append(Event(s.tag, s.index, s.sample, "x ", [7]))
                still.append(s)
            else:
                events.append(Event(s.tag, s.index, s.sample, "x ", [7], finished=True, finish_reason="length",
                                    text="x " * s.made, token_ids=[7] * s.made, usage=Usage(8, 0, s.made)))
        self.decode_tokens += len(self.running)
        self.running = still
        return events


def worker_main(redis_url: str, name: str, batch: int, steps: float, model_dir: str) -> None:
    """One simulated worker: the real Consumer on a SimEngine."""
    from transformers import AutoTokenizer

    from jobs import redis_url as urls
    from jobs.settings import Settings
    from worker.consumer import Consumer

    engine = SimEngine(batch, steps, AutoTokenizer.from_pretrained(model_dir))
    consumer = Consumer(engine, urls.connect(redis_url), Settings.from_env(), name=name, model=MODEL)
    consumer.run()


def redis_counters(conn) -> dict:
    cpu, stats, commands = conn.info("cpu"), conn.info("stats"), conn.info("commandstats")
    return {"cpu_s": cpu["used_cpu_user"] + cpu["used_cpu_sys"], "commands": sum(v["calls"] for v in commands.values()),
            "by_command": {k.removeprefix("cmdstat_"): (v["calls"], v["usec"]) for k, v in commands.items()},
            "bytes_in": stats["total_net_input_bytes"], "t": time.monotonic()}


def top_commands(a: dict, b: dict, samples: int, n: int = 8) -> dict:
    """The commands Redis spent most time in over the window: calls and microseconds per sample."""
    diff = {k: (c - a["by_command"].get(k, (0, 0))[0], u - a["by_command"].get(k, (0, 0))[1])
            for k, (c, u) in b["by_command"].items()}
    top = sorted(diff.items(), key=lambda kv: -kv[1][1])[:n]
    return {k: {"calls": round(c / max(1, samples), 2), "usec": round(u / max(1, samples), 1)} for k, (c, u) in top}


def run(workers: int, batch: int, steps: float, seconds: float, tokens: int, warmup: float = 5.0,
        followed: bool = False) -> dict:
    import redis

    from api import jobs
    from api.schemas import JobRequest
    from cli.redis_server import EmbeddedRedis
    from jobs.settings import Settings
    from results import keys
    from worker.engine.models.tiny import build_tiny_model

    work = os.path.join(ROOT, "bench", "out", "fleet_sim")
    os.makedirs(work, exist_ok=True)
    model_dir = os.path.join(work, "tokenizer-model")
    if not os.path.isdir(model_dir):
        build_tiny_model(model_dir, arch="llama")
    server = EmbeddedRedis()
    env = {**os.environ, "PYTHONPATH": ROOT, "REDIS_URL": server.url, "OMP_NUM_THREADS": "1"}
    settings = Settings.from_env()
    conn = redis.Redis.from_url(server.url)
    procs = []
    log = open(os.path.join(work, "workers.log"), "ab")
    try:
        for i in range(workers):
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", server.url, f"sim-{i}", str(batch),
                 str(steps), model_dir], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 120
        while sum(conn.hget(f"rq:worker:sim-{i}", "state") == b"idle" for i in range(workers)) < workers:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("the simulated workers did not start (bench/out/fleet_sim/workers.log)")
            time.sleep(0.2)
        # Enough work for the whole run: every worker busy throughout.
        per_job = 2000
        samples_needed = workers * batch * steps * (warmup + seconds + 10) / tokens
        ids = []
        for _ in range(int(samples_needed // per_job) + workers):
            req = JobRequest(prompts=["p"] * per_job, sampling_params={"max_new_tokens": tokens}, model=MODEL)
            ids.append(jobs.submit(conn, req, settings)["id"])
            if followed:  # as an API process marks a stream it follows: the workers send deltas
                conn.set(keys.followed(keys.stream(ids[-1])), 1, ex=3600)

        def done() -> tuple[int, int]:
            """(samples stored, shards ended) over every job."""
            with conn.pipeline(transaction=False) as pipe:
                for j in ids:
                    pipe.hget(keys.info(j), "samples_done")
                    pipe.hget(keys.shards(j), "ended")
                got = [int(v or 0) for v in pipe.execute()]
            return sum(got[0::2]), sum(got[1::2])

        time.sleep(warmup)
        a, (sa, ea) = redis_counters(conn), done()
        time.sleep(seconds)
        b, (sb, eb) = redis_counters(conn), done()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        conn.close()
        server.stop()
        log.close()
    dt, samples = b["t"] - a["t"], sb - sa
    per_k = 1000 / max(1, samples)
    cpu_per_sample = (b["cpu_s"] - a["cpu_s"]) / max(1, samples)
    gpu_samples_s = batch * steps / tokens  # one worker at the simulated rate
    saturating = 1.0 / (cpu_per_sample * gpu_samples_s) if cpu_per_sample else float("inf")
    return {"followed": followed, "workers": workers, "batch": batch, "steps": steps, "tokens_per_sample": tokens, "seconds": round(dt, 1),
            "samples": samples, "samples_per_s": round(samples / dt, 1), "shards_per_s": round((eb - ea) / dt, 1),
            "target_samples_per_s": round(workers * gpu_samples_s, 1),
            "steps_per_s": round(samples / dt * tokens / max(1, workers * batch), 1),
            "redis_cpu_s_per_1000_samples": round((b["cpu_s"] - a["cpu_s"]) * per_k, 3),
            "redis_commands_per_sample": round((b["commands"] - a["commands"]) / max(1, samples), 1),
            "redis_bytes_in_per_sample": round((b["bytes_in"] - a["bytes_in"]) / max(1, samples)),
            "redis_cpu_share": round((b["cpu_s"] - a["cpu_s"]) / dt, 3),
            "saturating_workers": round(saturating, 1), "workers_at_half_cpu": round(saturating / 2, 1),
            "per_sample_by_command": top_commands(a, b, samples)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        url, name, batch, steps, model_dir = sys.argv[2:7]
        worker_main(url, name, int(batch), float(steps), model_dir)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256, help="sequences a worker steps at once")
    ap.add_argument("--steps", type=float, default=30, help="engine steps a second")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per sample (max_new_tokens)")
    ap.add_argument("--seconds", type=float, default=20, help="the measured window")
    ap.add_argument("--followed", action="store_true", help="every job's stream followed (deltas sent), "
                                                            "as online requests and watched jobs are")
    args = ap.parse_args()
    from bench.out_file import save
    out = run(args.workers, args.batch, args.steps, args.seconds, args.tokens, followed=args.followed)
    save("fleet_sim", out)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
