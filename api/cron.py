"""Recurring jobs through rq's cron scheduler (`fanout cron CONFIG.json`).

    {"jobs": [
      {"name": "nightly-eval", "cron": "0 2 * * *",
       "job": {"prompts": ["..."], "sampling_params": {"max_new_tokens": 64}}},
      {"name": "hourly", "interval": 3600, "file": "prompts.jsonl",
       "sampling_params": {"temperature": 0}, "priority": "low"}
    ]}

Each entry has a `name`, a `cron` expression (local time) or an `interval` in seconds, and
either `job` (a POST /v1/jobs body) or `file` (a JSONL batch file, read again at every run,
relative to the config); optionally the `model` a `file` entry's runs go to (a `job` names its
own; either way, optional while the fleet serves one model) and a `tenant` (an API key's id, `fanout keys list`) whose
job each run is: that key sees it, and its rights and limits apply. rq's CronScheduler does
the timing, heartbeats and bookkeeping (`rq cron` monitoring sees it); each run is submitted
like a POST, JSON payload and all. A run that cannot be submitted (the file became invalid,
the key was revoked or is over a limit) is logged and skipped; the next runs go on.
"""
from __future__ import annotations

import json
import logging
import os
import time

from pydantic import ValidationError
from rq import cron_job_registry
from rq.cron import CronJob, CronScheduler
from rq.defaults import DEFAULT_CRON_JOB_HISTORY_LIMIT, DEFAULT_CRON_JOB_HISTORY_TTL

from starlette.exceptions import HTTPException

from jobs import models as fleet
from jobs import redis_url
from jobs.settings import Settings
from jobs.spec import JOB_FUNC, PRIORITIES, queue_name
from results import blobs

from . import batchfile, jobs, tenants
from .schemas import JobRequest

log = logging.getLogger("fanout.cron")


class SubmitJob(CronJob):
    """A cron entry that submits a Fanout job instead of enqueueing a Python call."""

    def __init__(self, name: str, entry: dict, base_dir: str, settings: Settings):
        self.entry, self.base_dir, self.settings = entry, base_dir, settings
        req = self.request()  # fail at load, not at 2 am
        # rq's bookkeeping names a queue; the runs go to their model's (resolved at each run).
        super().__init__(queue_name=queue_name(req.model or "(the fleet's model)", req.priority), func_name=JOB_FUNC,
                         name=name, cron=entry.get("cron"), interval=entry.get("interval"))

    def request(self) -> JobRequest:
        e = self.entry
        if "job" in e:
            return JobRequest.model_validate(e["job"])
        path = os.path.join(self.base_dir, e["file"])
        body = batchfile.job_body(path, e.get("sampling_params"), priority=e.get("priority", "normal"))
        return JobRequest.model_validate({**body, **({"model": e["model"]} if "model" in e else {})})

    def tenant(self, connection) -> tenants.Tenant | None:
        """The entry's tenant, looked up afresh (ValueError: unknown or revoked)."""
        tenant_id = self.entry.get("tenant")
        if tenant_id is None:
            return None
        tenant = tenants.by_id(connection, tenant_id)
        if tenant.revoked:
            raise ValueError(f"the API key {tenant_id!r} is revoked")
        return tenant

    def enqueue(self, connection) -> dict | None:
        """Submit one run; its JobCreated body (rq's scheduler does not use what this returns)."""
        try:
            created = jobs.submit(connection, self.request(), self.settings, tenant=self.tenant(connection),
                                  store=blobs.open_store(self.settings.storage_url))
        except (ValueError, OSError, tenants.OverLimit, HTTPException, blobs.StoreError,
                fleet.ModelError) as e:  # pydantic's too
            log.error("cron job %s: this run is skipped: %s", self.name, getattr(e, "detail", e))
            return None
        with connection.pipeline() as pipe:
            pipe.zadd(self.job_history_key, {created["id"]: time.time()})
            pipe.zremrangebyrank(self.job_history_key, 0, -(DEFAULT_CRON_JOB_HISTORY_LIMIT + 1))
            pipe.expire(self.job_history_key, DEFAULT_CRON_JOB_HISTORY_TTL)
            cron_job_registry.add(self.name, pipe)
            pipe.execute()
        return created


class Scheduler(CronScheduler):
    def add(self, job: SubmitJob) -> None:
        self._cron_jobs.append(job)


def load(path: str, connection, settings: Settings) -> Scheduler:
    """Parse and validate the config; errors name the entry and the field."""
    with open(path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON: {e}") from None
    entries = config.get("jobs") if isinstance(config, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected {{\"jobs\": [ ... ]}} with at least one entry")
    scheduler = Scheduler(connection=connection)
    scheduler.config_file = path
    for i, e in enumerate(entries):
        where = f"{path}: jobs[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not e["name"]:
            raise ValueError(f"{where}.name: a non-empty string is required")
        where += f" ({e['name']})"
        unknown = set(e) - {"name", "cron", "interval", "job", "file", "sampling_params", "priority", "tenant", "model"}
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
        if ("job" in e) == ("file" in e):
            raise ValueError(f"{where}: give exactly one of job, file")
        if e.get("priority", "normal") not in PRIORITIES:
            raise ValueError(f"{where}.priority: one of {sorted(PRIORITIES)}")
        if "model" in e and ("file" not in e or not isinstance(e["model"], str)):
            raise ValueError(f"{where}.model: a served model's name, with `file` (a `job` names its own)")
        if "tenant" in e and not isinstance(e["tenant"], str):
            raise ValueError(f"{where}.tenant: an API key id (a string; fanout keys list)")
        try:
            job = SubmitJob(e["name"], e, os.path.dirname(os.path.abspath(path)), settings)
        except ValidationError as err:
            first = err.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"{where}: {loc}: {first['msg']}") from None
        except (ValueError, OSError) as err:
            raise ValueError(f"{where}: {err}") from None
        try:
            job.tenant(connection)
        except ValueError as err:
            raise ValueError(f"{where}.tenant: {err}") from None
        scheduler.add(job)
    return scheduler


def run(path: str) -> None:
    settings = Settings.from_env()
    load(path, redis_url.connect(settings.redis_url), settings).start()
