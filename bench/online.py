"""Online requests' footprint in Redis: what N chat completions leave behind.

    python bench/online.py                          # 20,000 chats (1 token each), 32 clients
    python bench/online.py --requests 2000 --online-ttl 5

An embedded Redis, an API and a worker on bench/engine.py's toy model. Redis's memory
(`used_memory`) and key count are read before the requests (after a warm-up), right after
the last answer, and once FANOUT_ONLINE_TTL has passed (every online job's keys are gone
then: api/jobs.py create; `keys_left` names any that stayed). A tenth of the requests are refused by the worker (prompts longer
than the context: a 400), as refused requests used to keep their keys too. Results: stdout
and bench/out/online.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # bench/ itself is not put on the path: its datasets.py would hide Hugging Face's

import httpx  # noqa: E402
import redis  # noqa: E402

from bench.out_file import save  # noqa: E402
from cli.redis_server import EmbeddedRedis, free_port  # noqa: E402
from bench.service import spawn, wait  # noqa: E402


def memory(conn) -> dict:
    return {"used_memory": conn.info("memory")["used_memory"], "keys": conn.dbsize()}


def run(model: str, requests: int, clients: int, online_ttl: int, device: str = "cpu") -> dict:
    server = EmbeddedRedis()
    env = {**os.environ, "REDIS_URL": server.url, "PYTHONPATH": ROOT, "FANOUT_ONLINE_TTL": str(online_ttl)}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logs = os.path.join(ROOT, "bench", "out")
    os.makedirs(logs, exist_ok=True)
    api = spawn(["api", "--port", str(port)], env, os.path.join(logs, "online-api.log"))
    name = f"online-{os.getpid()}"
    worker = spawn(["worker", "--model", model, "--device", device, "--name", name], env,
                   os.path.join(logs, "online-worker.log"))
    conn = redis.Redis.from_url(server.url)
    served = os.path.basename(model.rstrip("/"))
    try:
        wait(lambda: conn.hget(f"rq:worker:{name}", "state") == b"idle", 300, "worker start")

        def api_up():
            try:
                return httpx.get(url + "/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False
        wait(api_up, 60, "API start")
        with httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_connections=clients)) as http:
            def chat(i: int) -> int:
                words = "word " * 2000 if i % 10 == 9 else f"question {i}: why?"
                r = http.post("/v1/chat/completions", json={"model": served, "max_tokens": 1, "messages": [
                    {"role": "user", "content": words}]})
                return r.status_code

            with ThreadPoolExecutor(clients) as pool:
                list(pool.map(chat, range(50)))  # warm-up: connections, the worker's tokenizer
                time.sleep(online_ttl + 2)  # the warm-up's jobs gone too
                before, known = memory(conn), set(conn.scan_iter(count=1000))
                t = time.perf_counter()
                codes = Counter(pool.map(chat, range(requests)))
                took = time.perf_counter() - t
            after = memory(conn)
            deadline = time.monotonic() + online_ttl + 30
            while time.monotonic() < deadline:  # until the last ended job's keys expired
                time.sleep(1)
                settled = memory(conn)
                if settled["keys"] <= before["keys"]:
                    break
            conn_left = set(conn.scan_iter(count=1000))
    finally:
        for p in (worker, api):
            if p.poll() is None:
                p.terminate()
                p.wait(60)
        conn.close()
        server.stop()
    left = sorted(k.decode() for k in set(conn_left) - known)[:10]
    return {"requests": requests, "clients": clients, "online_ttl": online_ttl, "codes": dict(codes),
            "seconds": took, "requests_s": requests / took, "before": before, "right_after": after,
            "after_grace": settled, "ratio_after_grace": settled["used_memory"] / before["used_memory"],
            "ratio_right_after": after["used_memory"] / before["used_memory"], "keys_left": left}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: bench/engine.py's toy model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--online-ttl", type=int, default=10, help="FANOUT_ONLINE_TTL for the run (seconds)")
    args = ap.parse_args()
    if args.model is None:
        from bench.engine import toy_model
        args.model = toy_model(os.path.join(ROOT, "bench", "out", "model"))
    out = run(args.model, args.requests, args.clients, args.online_ttl, args.device)
    save("online", out)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
