"""Webhooks: a signed POST when a job or a batch ends, at least once.

A job names its URL with `webhook_url` (POST /v1/jobs; OpenAI batches take it as an
extension), or takes its tenant's default (PUT /v1/webhooks). Only the hosts the operator
allows may be named (FANOUT_WEBHOOK_HOSTS, the SSRF rule of worker/engine/hosts.py: `*` lets
in public addresses only), checked at submit and again on the addresses each delivery
connects to.

The delivery is an outbox in Redis (keys.webhooks): the job's close (results/publisher.py)
or the batch's end (api/openai/batches.py) puts it there in the same transaction, so a
process that dies right after cannot lose it. Every API process sends what is due: it
takes a delivery by pushing it LEASE seconds ahead, POSTs, and removes it on a 2xx, or
makes it due again after the next wait of SCHEDULE (Standard Webhooks' schedule: 8 attempts
over about 27 hours), then gives up. A process that dies mid-send leaves it due again once
the lease is over: a receiver may see a delivery twice, with the same `webhook-id`.

Signed as Standard Webhooks (and OpenAI's webhooks) are: `webhook-id`, `webhook-timestamp`
(seconds; receivers refuse old ones, against replay) and `webhook-signature: v1,<base64 of
HMAC-SHA256 over "{id}.{timestamp}.{body}">` with the tenant's secret (`whsec_<base64>`,
made on first use, read with GET /v1/webhooks). The body is an event in OpenAI's shape:
`{"id", "object": "event", "type", "created_at", "data"}`: `job.succeeded`, `job.failed` or
`job.canceled` with the job (GET /v1/jobs/{id}'s body), `batch.completed`, `batch.failed`,
`batch.expired` or `batch.cancelled` with the batch object.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
from datetime import datetime

import anyio
import httpx
import redis as redis_lib
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field

from jobs.settings import Settings
from results import keys
from worker.engine.hosts import Hosts, Refused

from . import jobs
from .openai import batches

log = logging.getLogger("fanout.webhooks")
router = APIRouter(prefix="/v1")

SCHEDULE = (5, 300, 1800, 7200, 18000, 36000, 36000)  # seconds before each retry
TIMEOUT = 10.0  # seconds for one POST, connect to response
LEASE = 60  # seconds a sending process holds a delivery (over TIMEOUT: a live one finishes first)
AT_ONCE = 8  # deliveries one API process sends at a time
SETTING = "FANOUT_WEBHOOK_HOSTS"

# Take up to ARGV[3] deliveries due by ARGV[1], each pushed to ARGV[2] (the lease's end).
_TAKE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
for _, m in ipairs(due) do redis.call('ZADD', KEYS[1], ARGV[2], m) end
return due
"""


class Webhooks:
    """One API process's side of the outbox: the URL check at submit, and the sender."""

    def __init__(self, redis, settings: Settings):
        self.redis = redis
        self.settings = settings
        self.hosts = Hosts(settings.webhook_hosts, SETTING)

    def check(self, url: str, field: str = "webhook_url") -> str:
        """The URL, if the operator allows it: 422 naming `field` otherwise. Its addresses are
        looked up now too, so a private address is refused at submit, not a day later."""
        why = None
        if not self.settings.webhook_hosts:
            why = f"webhooks are off on this server (the operator allows hosts with {SETTING})"
        else:
            try:
                self.hosts.check_url(url)
                u = httpx.URL(url)
                self.hosts.addresses(u.host, u.port or (443 if u.scheme == "https" else 80))
            except (Refused, httpx.InvalidURL) as e:
                why = str(e)
        if why:
            raise RequestValidationError([{"loc": ("body", field), "type": "value_error", "msg": why}])
        return url

    def target(self, url: str | None, tenant) -> str | None:
        """The webhook a new job or batch gets: its own, else its tenant's default."""
        if url is not None:
            return self.check(url)
        return _text(self.redis.hget(keys.webhook(_tenant_id(tenant)), "url"))

    async def run(self) -> None:
        """Every API process, about once a second: send the deliveries due. One with
        webhooks off sends none (every API process of a fleet has the same settings)."""
        if not self.settings.webhook_hosts:
            return
        while True:
            await anyio.sleep(1.0)
            try:
                taken = await anyio.to_thread.run_sync(self.take)
            except redis_lib.RedisError as e:
                log.warning("webhooks: redis unavailable (%s); trying again", e)
                continue
            async with anyio.create_task_group() as tasks:
                for member in taken:
                    tasks.start_soon(anyio.to_thread.run_sync, self.send, member)

    def take(self) -> list[str]:
        now = time.time()
        return [_text(m) for m in self.redis.eval(_TAKE, 1, keys.webhooks(), now, now + LEASE, AT_ONCE)]

    def send(self, member: str) -> None:
        """One attempt of one delivery, and its outcome recorded."""
        try:
            event = self.event(member)
            if event is None:  # its job or batch expired meanwhile: nothing left to say
                self._forget(member)
                return
            url, tenant = event.pop("_url"), event.pop("_tenant")
            body = json.dumps(event, separators=(",", ":"))
            self._record(member, self._post(url, event["id"], body, secret(self.redis, tenant)))
        except redis_lib.RedisError as e:  # due again when its lease ends
            log.warning("webhooks: %s not sent, redis unavailable (%s)", member, e)
        except Exception:  # noqa: BLE001 - one bad delivery must not stop the others
            log.exception("webhooks: %s could not be sent", member)

    def event(self, member: str) -> dict | None:
        """The event for a delivery (with its URL and tenant under `_url` and `_tenant`, not
        sent), or None."""
        kind, _, oid = member.partition(":")
        if kind == "job":
            try:
                job = jobs.describe(self.redis, oid)
            except jobs.JobNotFound:
                return None
            url, tenant = map(_text, self.redis.hmget(keys.info(oid), "webhook", "tenant"))
            ended = job["ended_at"]
            when = int(datetime.fromisoformat(ended.replace("Z", "+00:00")).timestamp()) if ended else int(time.time())
            return {"id": f"evt_{oid}", "object": "event", "type": f"job.{job['status']}", "created_at": when,
                    "data": job, "_url": url, "_tenant": tenant}
        if kind == "batch":
            record = batches.load(self.redis, oid)
            if record is None:
                return None
            when = max(v for k, v in record.items() if k.endswith("_at") and isinstance(v, int))
            return {"id": f"evt_{oid}", "object": "event", "type": f"batch.{record['status']}", "created_at": when,
                    "data": batches.public(self.redis, record), "_url": record.get("_webhook"),
                    "_tenant": record.get("_tenant")}
        raise ValueError(f"not a delivery: {member!r}")

    def _post(self, url: str, msg_id: str, body: str, key: str) -> str | None:
        """POST the body; None once a 2xx came back, else why not (no redirects followed)."""
        stamp = str(int(time.time()))
        headers = {"content-type": "application/json", "user-agent": "fanout-webhooks",
                   "webhook-id": msg_id, "webhook-timestamp": stamp,
                   "webhook-signature": sign(key, msg_id, stamp, body)}
        try:
            with self.hosts.client(TIMEOUT, follow_redirects=False) as client:
                r = client.post(url, content=body.encode(), headers=headers)
        except Refused as e:
            return str(e)
        except httpx.TimeoutException:
            return f"no answer within {TIMEOUT:g} s"
        except httpx.HTTPError:
            return "could not be reached (no connection)"
        return None if 200 <= r.status_code < 300 else f"HTTP {r.status_code}"

    def _record(self, member: str, error: str | None) -> None:
        attempts = int(self.redis.hincrby(keys.webhook_attempts(), member, 1))
        kind, _, oid = member.partition(":")
        state = {"webhook_attempts": attempts, "webhook_error": error or ""}
        if error is None:
            state["webhook_status"] = "delivered"
        elif attempts > len(SCHEDULE):
            state["webhook_status"] = "failed"
            log.error("webhooks: %s given up after %d attempts: %s", member, attempts, error)
        else:
            log.warning("webhooks: %s attempt %d failed (%s); again in %d s", member, attempts, error,
                        SCHEDULE[attempts - 1])
        with self.redis.pipeline() as pipe:
            if kind == "job" and self.redis.exists(keys.info(oid)):
                pipe.hset(keys.info(oid), mapping=state)
            if "webhook_status" in state:
                pipe.zrem(keys.webhooks(), member)
                pipe.hdel(keys.webhook_attempts(), member)
            else:
                pipe.zadd(keys.webhooks(), {member: time.time() + SCHEDULE[attempts - 1]})
            pipe.execute()

    def _forget(self, member: str) -> None:
        with self.redis.pipeline() as pipe:
            pipe.zrem(keys.webhooks(), member)
            pipe.hdel(keys.webhook_attempts(), member)
            pipe.execute()


def sign(key: str, msg_id: str, stamp: str, body: str) -> str:
    """Standard Webhooks' signature header value for a body."""
    mac = hmac.new(base64.b64decode(key.removeprefix("whsec_")), f"{msg_id}.{stamp}.{body}".encode(),
                   hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def secret(redis, tenant_id: str | None) -> str:
    """The tenant's signing secret, made on first use (the same one for every API process)."""
    key = keys.webhook(tenant_id)
    redis.hsetnx(key, "secret", "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode())
    return _text(redis.hget(key, "secret"))


class WebhookSettings(BaseModel):
    url: str | None = Field(description="the default webhook of your jobs and batches that name none (null: none)")
    secret: str = Field(description="the signing secret (whsec_...): verify each delivery's webhook-signature with it")


class WebhookUpdate(BaseModel):
    url: str | None = Field(None, min_length=1, max_length=2048, description=(
        "the default webhook of your jobs and batches that name none; null removes it"))


@router.get("/webhooks", response_model=WebhookSettings, tags=["webhooks"])
def read_settings(request: Request):
    """Your webhook settings: the default URL and the secret that signs every delivery."""
    redis, tenant_id = request.app.state.redis, _tenant_id(request.state.tenant)
    key = secret(redis, tenant_id)
    return {"url": _text(redis.hget(keys.webhook(tenant_id), "url")), "secret": key}


@router.put("/webhooks", response_model=WebhookSettings, tags=["webhooks"])
def update_settings(body: WebhookUpdate, request: Request):
    """Set (or, with `url: null`, remove) your default webhook."""
    st, tenant_id = request.app.state, _tenant_id(request.state.tenant)
    if body.url is None:
        st.redis.hdel(keys.webhook(tenant_id), "url")
    else:
        st.redis.hset(keys.webhook(tenant_id), "url", st.webhooks.check(body.url, "url"))
    return read_settings(request)


def _tenant_id(tenant) -> str | None:
    return tenant.id if tenant else None


def _text(v):
    return v.decode() if isinstance(v, bytes) else v
