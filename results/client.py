"""Python client of the HTTP API: submit, follow the stream (SSE, resuming after a dropped
connection), fetch results.

    from results.client import Client
    c = Client("http://localhost:8000")
    items = c.run(prompts=["Hello", "Bonjour"], sampling_params={"max_new_tokens": 32, "n": 2})
    items[0]["samples"][1]["text"]
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from .events import is_terminal


class ApiError(RuntimeError):
    def __init__(self, status: int, detail: Any):
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


class JobFailed(RuntimeError):
    def __init__(self, job_id: str, status: str, error: str | None):
        super().__init__(f"job {job_id} {status}" + (f": {error}" if error else ""))
        self.job_id, self.status, self.error = job_id, status, error


def _check(r: httpx.Response) -> Any:
    if r.status_code >= 400:
        try:
            body = r.json()
            detail = body.get("detail") or (body.get("error") or {}).get("message")  # native, OpenAI's
        except ValueError:
            detail = r.text
        raise ApiError(r.status_code, detail)
    return r.json()


LONG = 3600.0  # seconds: an upload


class Client:
    def __init__(self, url: str = "http://localhost:8000", timeout: float = 30.0, api_key: str | None = None):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def submit(self, body: dict | None = None, idempotency_key: str | None = None, **fields) -> dict:
        """POST /v1/jobs with `body` (or keyword fields: prompts=..., sampling_params=...).
        Returns {id, status, stream, seed, items, replayed}; a dataset's job comes back
        `validating` (items null), its lines checked after (events() follows it)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        r = self.http.post("/v1/jobs", json={**(body or {}), **fields}, headers=headers)
        # `replayed`: the key was used before with this body; this is that job.
        return {**_check(r), "replayed": r.headers.get("Idempotent-Replayed") == "true"}

    def upload(self, path: str, purpose: str = "dataset") -> dict:
        """POST /v1/files: the file at `path`, streamed from disk; returns its object."""
        with open(path, "rb") as f:
            return _check(self.http.post("/v1/files", files={"file": (os.path.basename(path), f)},
                                         data={"purpose": purpose}, timeout=LONG))

    def delete_file(self, file_id: str) -> dict:
        return _check(self.http.delete(f"/v1/files/{file_id}"))

    def status(self, job_id: str) -> dict:
        return _check(self.http.get(f"/v1/jobs/{job_id}"))

    def cancel(self, job_id: str) -> dict:
        return _check(self.http.post(f"/v1/jobs/{job_id}/cancel"))

    def results(self, job_id: str, page_size: int = 1000) -> list[dict]:
        """Every item, in index order, with its finished samples."""
        return list(self.iter_results(job_id, page_size))

    def iter_results(self, job_id: str, page_size: int = 1000) -> Iterator[dict]:
        """results(), a page at a time: memory for one page, whatever the job's size."""
        offset = 0
        while offset is not None:
            page = _check(self.http.get(f"/v1/jobs/{job_id}/results",
                                        params={"offset": offset, "limit": page_size}))
            yield from page["items"]
            offset = page["next_offset"]

    def events(self, job_id: str, last_event_id: str | None = None, timeout: float | None = None,
               retries: int = 5) -> Iterator[tuple[str, dict]]:
        """Yield (stream entry id, entry) until the terminal status. A dropped connection is
        resumed from the last id received (`retries` times in a row at most)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        failures = 0
        while True:
            headers = {"Accept": "text/event-stream"}
            if last_event_id:
                headers["Last-Event-ID"] = last_event_id
            try:
                with self.http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers,
                                      timeout=httpx.Timeout(10.0, read=60.0)) as r:
                    if r.status_code >= 400:
                        r.read()
                        _check(r)
                    for entry_id, entry in _parse_sse(r.iter_lines()):
                        failures = 0
                        last_event_id = entry_id
                        yield entry_id, entry
                        if is_terminal(entry):
                            return
                        if deadline is not None and time.monotonic() > deadline:
                            raise TimeoutError(f"job {job_id}: not done within {timeout}s")
                error: Exception = ConnectionError("event stream ended before the job did")
            except httpx.TransportError as e:
                error = e
            failures += 1
            if failures > retries:
                raise error
            time.sleep(min(0.2 * 2 ** failures, 5.0))

    def run(self, body: dict | None = None, on_event: Callable[[str, dict], None] | None = None,
            timeout: float | None = None, **fields) -> list[dict]:
        """Submit, follow the stream to the end, return the results (raises JobFailed if the
        job failed or was canceled)."""
        job = self.submit(body, **fields)
        for entry_id, entry in self.events(job["id"], timeout=timeout):
            if on_event:
                on_event(entry_id, entry)
        info = self.status(job["id"])
        if info["status"] != "succeeded":
            raise JobFailed(job["id"], info["status"], info["error"])
        return self.results(job["id"])


def _parse_sse(lines) -> Iterator[tuple[str, dict]]:
    entry_id, data = None, []
    for line in lines:
        if not line:
            if data and entry_id is not None:
                yield entry_id, json.loads("\n".join(data))
            entry_id, data = None, []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "id":
                entry_id = value
            elif name == "data":
                data.append(value)
