"""Authentication: one router-level dependency (api.app), so every route under /v1 needs a
key once keys exist; /healthz and the docs stay open. The tenant is `request.state.tenant`
(None in open mode, where every client sees every job)."""
from __future__ import annotations

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from results import keys

from . import tenants
from .schemas import ErrorOut, LimitOut

RESPONSES = {
    401: {"model": ErrorOut, "description": "missing, unknown or revoked API key (`Authorization: Bearer fo_...`, "
                                            "or `x-api-key: fo_...`)"},
    429: {"model": LimitOut, "description": "over one of this API key's limits (`limit` names it)"},
}

# auto_error=False: in open mode a request without a key (or with any key, as OpenAI clients
# always send one) is served.
bearer = HTTPBearer(auto_error=False, description="an API key from `fanout keys create`")


def authenticate(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    redis = request.app.state.redis
    # Anthropic's clients send the key as x-api-key.
    key = credentials.credentials if credentials else request.headers.get("x-api-key")
    tenant = tenants.lookup(redis, key) if key else None
    if tenant is None or tenant.revoked:
        if tenants.enabled(redis):
            why = "revoked API key" if tenant else "invalid API key" if key else "missing API key"
            raise HTTPException(401, f"{why}: send Authorization: Bearer <key>",
                                headers={"WWW-Authenticate": "Bearer"})
        tenant = None
    if tenant is not None and "requests_per_second" in tenant.limits:
        _count_request(redis, tenant)
    request.state.tenant = tenant


# GCRA (a token bucket kept as one timestamp): each request moves the tenant's "due" time
# 1/limit s on; one is refused while that would put it more than 1 s ahead of now. So a key
# gets `limit` requests at once, then `limit` a second, whatever the clock's second
# boundaries (a fixed window let twice the limit through across one). Redis's clock, so every
# API process agrees; returns 0 (pass) or the milliseconds until a request would pass.
RATE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local due = math.max(tonumber(redis.call('GET', KEYS[1]) or now), now)
local next_due = due + tonumber(ARGV[1])
if next_due - now > 1000 then
  return math.ceil(next_due - now - 1000)
end
redis.call('SET', KEYS[1], tostring(next_due), 'PX', math.ceil(next_due - now))
return 0
"""


def _count_request(redis, tenant: tenants.Tenant) -> None:
    limit = tenant.limits["requests_per_second"]
    wait_ms = redis.eval(RATE, 1, keys.rate(tenant.id), 1000 / limit)
    if wait_ms:
        raise tenants.OverLimit("requests_per_second",
                                f"over this API key's limit of {limit} requests per second (requests_per_second)",
                                retry_after=max(1, -(-wait_ms // 1000)))


def admin(request: Request) -> None:
    """For the operator's routes (GET /v1/fleet): an admin key (`fanout keys create --admin`),
    or anyone in open mode. Runs after authenticate."""
    tenant = request.state.tenant
    if tenant is not None and not tenant.admin:
        raise HTTPException(403, "this API key is not an admin key: the fleet is shown to admin keys only "
                                 "(fanout keys create --admin)")
