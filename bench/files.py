"""An OpenAI batch's files and what they cost the service: Redis's memory and the API's peak
RSS for one batch of N lines (upload, create, run, finalize, download), for this checkout
and, with --vs, another one (e.g. the commit before the blob store) side by side in one run.

    python bench/files.py                               # 50,000 lines, this checkout
    python bench/files.py --vs /tmp/fanout-before       # and that checkout, in turn
    (git worktree add /tmp/fanout-before COMMIT makes one)

Each checkout gets a Redis, a worker and an API process of its own, started from its own
code, the same tiny random-weight model (built offline), and the same file: one
/v1/chat/completions line per request, a ~300-character question, max_tokens 1, sent and
read with the official `openai` client (files.create, batches.create and retrieve,
files.content streamed), as a user would. Reported:
the file's size; Redis's used_memory after the upload and once the output file has been
read (less the empty service's), and its peak; the bytes of the files' keys in Redis
(their metadata: the files themselves are in the blob store); the API process's peak RSS
(VmHWM); the seconds for each step. Results: stdout and bench/out/files.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import httpx  # noqa: E402
import openai  # noqa: E402
import redis as redis_lib  # noqa: E402

from bench.out_file import save  # noqa: E402
from worker.engine.models.tiny import build_tiny_model  # noqa: E402
from cli.redis_server import EmbeddedRedis, free_port  # noqa: E402


def batch_file(path: str, lines: int) -> int:
    question = "Please explain, step by step and with an example, how a paged key-value cache works. " * 4
    with open(path, "w") as f:
        for i in range(lines):
            f.write(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "llama", "max_tokens": 1, "temperature": 0,
                                         "messages": [{"role": "user", "content": f"{i}: {question}"}]}}) + "\n")
    return os.path.getsize(path)


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def used_mb(r) -> tuple[float, float]:
    info = r.info("memory")
    return info["used_memory"] / 2**20, info["used_memory_peak"] / 2**20


def run(root: str, model: str, path: str, lines: int, work: str) -> dict:
    server = EmbeddedRedis()
    env = {**os.environ, "REDIS_URL": server.url, "PYTHONPATH": root, "FANOUT_STORAGE_URL": f"file://{work}/blobs",
           "FANOUT_BATCH_MAX_REQUESTS": str(lines)}
    me = [sys.executable, "-m", "cli.main"]
    port = free_port()
    logs = open(os.path.join(work, "service.log"), "ab")
    worker = subprocess.Popen(me + ["worker", "--model", model, "--device", "cpu", "--drain-timeout", "0"],
                              cwd=root, env=env, stdout=logs, stderr=subprocess.STDOUT)
    api = subprocess.Popen(me + ["api", "--port", str(port)], cwd=root, env=env, stdout=logs, stderr=subprocess.STDOUT)
    r = redis_lib.Redis.from_url(server.url)
    url = f"http://127.0.0.1:{port}"
    try:
        http = httpx.Client(base_url=url, timeout=600)
        deadline = time.monotonic() + 120
        while True:  # the API answers and the worker's model is served
            try:
                if http.get("/v1/models").json().get("data"):
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and api.poll() is None and worker.poll() is None, "service did not start"
            time.sleep(0.2)
        base, _ = used_mb(r)
        out = {"file_mb": os.path.getsize(path) / 2**20}
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0)
        t = time.perf_counter()
        with open(path, "rb") as f:
            file_id = client.files.create(file=f, purpose="batch").id
        out["upload_s"] = time.perf_counter() - t
        out["redis_after_upload_mb"] = used_mb(r)[0] - base
        t = time.perf_counter()
        b = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        while b.status not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.5)
            b = client.batches.retrieve(b.id)
        out["batch_s"] = time.perf_counter() - t
        assert b.status == "completed" and b.request_counts.completed == lines, b
        t = time.perf_counter()
        got, n = set(), 0
        with client.files.with_streaming_response.content(b.output_file_id) as resp:
            for line in resp.iter_lines():
                if line:
                    got.add(json.loads(line)["custom_id"])
                    n += 1
        out["download_s"] = time.perf_counter() - t
        assert n == lines and got == {f"q{i}" for i in range(lines)}, (n, len(got))  # every line, once
        now, peak = used_mb(r)
        out["redis_files_bytes"] = sum(r.memory_usage(k) or 0 for k in r.scan_iter("fanout:file*"))
        out.update(redis_after_batch_mb=now - base, redis_peak_mb=peak - base, api_peak_rss_mb=peak_rss_mb(api.pid))
        return out
    finally:
        for p in (api, worker):
            p.terminate()
            p.wait(60)
        r.close()
        server.stop()
        logs.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=50_000)
    ap.add_argument("--vs", default=None, help="another checkout to run the same batch with, after this one")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="fanout-bench-files-")
    model = build_tiny_model(os.path.join(work, "llama"), arch="llama")
    path = os.path.join(work, "in.jsonl")
    batch_file(path, args.lines)
    figures = {"lines": args.lines}
    for name, root in (("this", ROOT), ("vs", args.vs)):
        if root:
            os.makedirs(os.path.join(work, name), exist_ok=True)
            figures[name] = {"root": root, **run(os.path.abspath(root), model, path, args.lines,
                                                  os.path.join(work, name))}
            print(name, json.dumps(figures[name], indent=1))
    print("->", save("files", figures))


if __name__ == "__main__":
    main()
