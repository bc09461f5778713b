"""An idle SSE stream at the default keep-alive (15 s) stays open: the relay's blocking XREAD
outlasts redis-py's default 5 s socket timeout only if the API's client allows it."""
import json
import time
from datetime import datetime, timedelta, timezone

import httpx

from conftest import LIMITS, start_api

HOLD_S = 25  # the most it waits for its first keep-alive (at 15 s)


def test_idle_stream_gets_keepalives_at_the_default_interval(redis_url, worker, tmp_path, monkeypatch):
    # worker: the model it serves is known, so the job is taken (and scheduled).
    # The shared fixtures use a 1 s keep-alive, under redis-py's 5 s timeout: this API uses 15 s.
    monkeypatch.setitem(LIMITS, "FANOUT_SSE_KEEPALIVE", "15")
    api, url = start_api(redis_url, tmp_path, "api-idle")
    try:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(10.0, read=30.0)) as http:
            run_at = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
            job = http.post("/v1/jobs", json={"prompts": ["a"], "run_at": run_at}).json()
            assert job["status"] == "scheduled"
            with http.stream("GET", f"/v1/jobs/{job['id']}/events") as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                start, keepalives = time.monotonic(), 0
                for line in lines:
                    keepalives += line == ": keep-alive"
                    if keepalives == 1 or time.monotonic() - start >= HOLD_S:
                        break
                waited = time.monotonic() - start
                # The default's (not the fixtures' 1 s), past redis-py's 5 s socket timeout.
                assert keepalives == 1 and waited >= 14, f"{keepalives} keep-alives in {waited:.1f} s"
                assert api.alive() and not r.is_closed

                assert http.post(f"/v1/jobs/{job['id']}/cancel").json()["status"] == "canceled"
                data = [json.loads(x[len("data: "):]) for x in lines if x.startswith("data: ")]
            assert data[-1]["type"] == "status" and data[-1]["status"] == "canceled"
    finally:
        api.stop()
    with open(api.log_path) as f:
        log = f.read()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
