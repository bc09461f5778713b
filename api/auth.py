"""Authentication: one router-level dependency (api.app), so every route under /v1 needs a
key once keys exist; /healthz and the docs stay open. The tenant is `request.state.tenant`
(None in open mode, where every client sees every job)."""
from __future__ import annotations

import time

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from results import keys

from . import tenants
from .schemas import ErrorOut, LimitOut

RESPONSES = {
    401: {"model": ErrorOut, "description": "missing, unknown or revoked API key (`Authorization: Bearer fo_...`)"},
    429: {"model": LimitOut, "description": "over one of this API key's limits (`limit` names it)"},
}

# auto_error=False: in open mode a request without a key (or with any key, as OpenAI clients
# always send one) is served.
bearer = HTTPBearer(auto_error=False, description="an API key from `fanout keys create`")


def authenticate(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    redis = request.app.state.redis
    tenant = tenants.lookup(redis, credentials.credentials) if credentials else None
    if tenant is None or tenant.revoked:
        if tenants.enabled(redis):
            why = "revoked API key" if tenant else "invalid API key" if credentials else "missing API key"
            raise HTTPException(401, f"{why}: send Authorization: Bearer <key>",
                                headers={"WWW-Authenticate": "Bearer"})
        tenant = None
    if tenant is not None and "requests_per_second" in tenant.limits:
        _count_request(redis, tenant)
    request.state.tenant = tenant


def _count_request(redis, tenant: tenants.Tenant) -> None:
    """A fixed one-second window per tenant: simple, and at most twice the rate across a boundary."""
    key = keys.requests(tenant.id, int(time.time()))
    with redis.pipeline() as pipe:
        pipe.incr(key)
        pipe.expire(key, 2)
        count, _ = pipe.execute()
    limit = tenant.limits["requests_per_second"]
    if count > limit:
        raise tenants.OverLimit("requests_per_second",
                                f"over this API key's limit of {limit} requests per second (requests_per_second)",
                                retry_after=1)  # the next window opens within a second
