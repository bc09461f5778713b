"""GET /v1/jobs?status=... at 100,000 jobs: from the status index (results/listing.py) vs
describing every job newest first until a page is found (what the listing did before),
side by side in one run, on a Redis of its own.

    python bench/listing.py                 # 100,000 jobs, 20 of them running
    python bench/listing.py --jobs 20000

The jobs are submitted as the API does (api.jobs.submit, one transaction each: info hash,
stream entry, rq shards, listing and index); no worker runs, so all are queued but those
moved to running (as a shard's claim does) among the oldest, the worst case of a scan.
Each query runs --repeat times; the median is reported. Results: stdout and
bench/out/listing.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import redis as redis_lib  # noqa: E402

from api import jobs  # noqa: E402
from api.schemas import JobRequest  # noqa: E402
from results import keys, listing  # noqa: E402
from cli.redis_server import EmbeddedRedis  # noqa: E402
from jobs.settings import Settings  # noqa: E402
from bench.out_file import save  # noqa: E402


def scan(r, status: str, limit: int) -> list[str]:
    """The listing before its index: every job newest first, described, until `limit` match."""
    found, start = [], 0
    while len(found) < limit:
        ids = [i.decode() for i in r.zrevrange(keys.jobs(None), start, start + 99)]
        if not ids:
            break
        start += len(ids)
        for job_id in ids:
            if jobs.describe(r, job_id)["status"] == status:
                found.append(job_id)
                if len(found) == limit:
                    break
    return found


def timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--running", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    server = EmbeddedRedis()
    try:
        r = redis_lib.Redis.from_url(server.url)
        settings = Settings(redis_url=server.url)
        req = JobRequest(prompts=["x"])
        t = time.perf_counter()
        ids = [jobs.submit(r, req, settings)["id"] for _ in range(args.jobs)]
        submit_s = time.perf_counter() - t
        running = ids[: args.running]  # the oldest: a newest-first scan reaches them last
        for job_id in running:
            listing.set_state(r, job_id, "running")
        index_s, page = timed(lambda: jobs.listing(r, None, None, args.running, "running")[0], args.repeat)
        assert sorted(j["id"] for j in page) == sorted(running)
        scan_s, found = timed(lambda: scan(r, "running", args.running), max(1, args.repeat // 2))
        assert sorted(found) == sorted(running)
        plain_s, _ = timed(lambda: jobs.listing(r, None, None, 20)[0], args.repeat)
        out = {"jobs": args.jobs, "running": args.running, "submit_per_job_ms": 1e3 * submit_s / args.jobs,
               "status_index_ms": 1e3 * index_s, "status_scan_ms": 1e3 * scan_s,
               "scan_over_index": scan_s / index_s, "plain_page_ms": 1e3 * plain_s,
               "redis_used_memory_mb": r.info("memory")["used_memory"] / 2**20}
    finally:
        server.stop()
    print(json.dumps(out, indent=2))
    save("listing", out)


if __name__ == "__main__":
    main()
