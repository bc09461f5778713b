"""API keys, each one a tenant: created, listed and revoked by the operator (`fanout keys`,
straight to Redis), looked up by the API on every request (api.auth).

A key is a random token (`fo_...`) shown once at creation; Redis keeps only its sha256
(the token has 256 random bits, so an unsalted hash cannot be searched back). Auth is on
as soon as one key was ever created, revoked ones included: revoking the last key locks
clients out rather than opening every job to everyone.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from starlette.exceptions import HTTPException  # FastAPI's own would cost every CLI start 0.4 s

from jobs import unavailable
from results import keys

# Per-key limits; a limit left out is not enforced (the service's own FANOUT_MAX_* still are).
LIMITS = {
    "items_per_job": "items in one job",
    "tokens_per_job": "tokens one job may generate: the sum over items of n x max_new_tokens",
    "jobs_in_flight": "jobs validating, queued, scheduled or running at once",
    "requests_per_second": "API requests a second, every route (as many at once, then that rate)",
    "file_bytes": "bytes of batch input files kept at once (uploads; deleted or expired ones free theirs)",
}


class OverLimit(Exception):
    """A per-key limit was hit: 429, the body names the limit (api.app). `retry_after`:
    seconds until a retry can pass (the Retry-After header): exact for the request rate, a
    few seconds where a slot or room frees as jobs end or files go, and none for a job too
    big for the key, which no wait lets through."""

    WAITING_HELPS = ("jobs_in_flight", "file_bytes")

    def __init__(self, limit: str, detail: str, retry_after: int | None = None):
        super().__init__(detail)
        if retry_after is None and limit in self.WAITING_HELPS:
            retry_after = unavailable.RETRY_AFTER
        self.limit, self.detail, self.retry_after = limit, detail, retry_after


@dataclass(slots=True)
class Tenant:
    id: str
    name: str
    created_at: str
    revoked: bool = False
    limits: dict[str, int] = field(default_factory=dict)  # names from LIMITS
    may_use_high_priority: bool = False
    admin: bool = False  # sees the fleet (GET /v1/fleet); its jobs are its own all the same

    def check_job(self, priority: str, items: int, tokens: int) -> None:
        """The per-job rights and limits, before anything is written."""
        if priority == "high" and not self.may_use_high_priority:
            raise HTTPException(403, "priority: high is not allowed for this API key")
        for name, value in (("items_per_job", items), ("tokens_per_job", tokens)):
            limit = self.limits.get(name)
            if limit is not None and value > limit:
                raise OverLimit(name, f"{value} {LIMITS[name]}, over this API key's limit of {limit} ({name})")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def enabled(redis) -> bool:
    return bool(redis.exists(keys.api_keys()))


def create(redis, name: str, limits: dict[str, int], may_use_high_priority: bool = False,
           admin: bool = False) -> tuple[str, Tenant]:
    """A new key and its tenant; the key is returned here only."""
    key = "fo_" + secrets.token_urlsafe(32)
    tenant = Tenant(id=uuid.uuid4().hex[:12], name=name, limits=limits,
                    created_at=datetime.now(timezone.utc).isoformat().replace("+00:00", "Z"),
                    may_use_high_priority=may_use_high_priority, admin=admin)
    with redis.pipeline() as pipe:
        pipe.set(keys.api_key(digest(key)), json.dumps(asdict(tenant)))
        pipe.hset(keys.api_keys(), tenant.id, digest(key))
        pipe.execute()
    return key, tenant


def lookup(redis, key: str) -> Tenant | None:
    raw = redis.get(keys.api_key(digest(key)))
    return Tenant(**json.loads(raw)) if raw else None


def all_tenants(redis) -> list[Tenant]:
    digests = redis.hvals(keys.api_keys())
    records = redis.mget([keys.api_key(d.decode()) for d in digests]) if digests else []
    return sorted((Tenant(**json.loads(r)) for r in records if r), key=lambda t: t.created_at)


def by_id(redis, tenant_id: str) -> Tenant:
    """The tenant of a key id (`fanout keys list`), revoked or not; ValueError if unknown."""
    d = redis.hget(keys.api_keys(), tenant_id)
    raw = redis.get(keys.api_key(d.decode())) if d else None
    if raw is None:
        raise ValueError(f"no API key with id {tenant_id}")
    return Tenant(**json.loads(raw))


def revoke(redis, tenant_id: str) -> Tenant:
    """Revoke a key for good (its record stays, for `fanout keys list`); raises ValueError
    for an unknown id."""
    tenant = by_id(redis, tenant_id)
    tenant.revoked = True
    redis.set(keys.api_key(redis.hget(keys.api_keys(), tenant_id).decode()), json.dumps(asdict(tenant)))
    return tenant


def revoked_among(redis, tenant_ids: set[str]) -> set[str]:
    """Those of these tenants whose key is revoked (or gone): two round trips for all."""
    ids = sorted(tenant_ids)
    digests = redis.hmget(keys.api_keys(), ids)
    records = redis.mget([keys.api_key(d.decode()) for d in digests if d is not None]) if any(digests) else []
    live = {t.id for t in (Tenant(**json.loads(r)) for r in records if r) if not t.revoked}
    return set(ids) - live


def in_flight(redis, tenant_id: str) -> int:
    return int(redis.get(keys.inflight(tenant_id)) or 0)
