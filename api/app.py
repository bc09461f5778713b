"""The FastAPI app. Stateless: run as many processes as you like behind one port
(`fanout api --workers N`); all state is in Redis.

    uvicorn --factory api.app:create_app       # settings from the environment (jobs.settings)
"""
from __future__ import annotations

import logging
import os
from contextlib import asynccontextmanager

import anyio
import redis
from fastapi import Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from swagger_ui_bundle import swagger_ui_path

from jobs import models as fleet
from jobs import redis_url, unavailable
from jobs.settings import Settings
from results import blobs, keys

from . import auth, metrics, openapi, streams, sweep, tenants, tokenize, webhooks
from .anthropic import router as anthropic_router
from .anthropic.errors import RESPONSES as ANTHROPIC_ERRORS
from .anthropic.errors import AnthropicError, is_anthropic
from .fleet import router as fleet_router
from .openai import batches
from .openai import router as openai_router
from .openai.errors import RESPONSES as OPENAI_ERRORS
from .openai.errors import OpenAIError, from_validation, is_openai
from .schemas import UNION_TAGS, ErrorOut, Health, Version
from .submit import router

UI = os.path.join(os.path.dirname(__file__), "ui")  # the dashboard's files (/ui)
UNAVAILABLE = {503: {"model": ErrorOut, "description": "Redis is unavailable or out of memory (try again after Retry-After)"}}


def _retry(cls=Retry):
    # A pooled connection that Redis closed (a restart) fails once and is replaced at once;
    # while Redis is away a request gets its 503 within a fraction of a second.
    return cls(ExponentialBackoff(cap=0.2, base=0.02), 2)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()
    fleet.configured()  # a malformed FANOUT_MODELS stops the API at start, not each request

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.settings = settings
        app.state.redis = redis_url.connect(settings.redis_url, retry=_retry(), socket_connect_timeout=2)
        app.state.blobs = blobs.open_store(settings.storage_url)
        try:
            blobs.same_store(app.state.redis, app.state.blobs)
        except redis.RedisError as e:  # checked by the next process that starts with Redis up
            logging.getLogger("fanout.api").warning("cannot check the blob store against Redis yet: %s", e)
        try:
            if not tenants.enabled(app.state.redis):
                logging.getLogger("fanout.api").warning(
                    "no API keys: every client sees every job (`fanout keys create` turns auth on)")
        except redis.RedisError as e:  # Redis not up yet: every request checks for itself
            logging.getLogger("fanout.api").warning("cannot tell yet whether API keys exist: %s", e)
        # Short reads only (the blocking one is the stream hub's own connection); a pool that
        # waits for a free connection, so a thousand followers starting at once queue for it
        # instead of failing with "Too many connections".
        # (A connect timeout counts this process's event loop too: 10 s, not 2, so a loop busy
        # with a thousand streams does not fail a read that Redis would answer.)
        app.state.aredis = redis_url.connect_async(settings.redis_url, pool=64, wait=30, retry=_retry(AsyncRetry),
                                                   socket_connect_timeout=10, socket_timeout=30)

        async def revoked(ids: set[str]) -> set[str]:
            return await anyio.to_thread.run_sync(tenants.revoked_among, app.state.redis, ids)

        app.state.webhooks = webhooks.Webhooks(app.state.redis, settings)
        app.state.hub = streams.Hub(settings.redis_url, app.state.aredis, settings.max_streams, revoked)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(batches.sweep, app.state)  # OpenAI batches: expiry, finalization
            tasks.start_soon(sweep.run, app.state)  # the blob store: expired files' bytes, jobs' items
            tasks.start_soon(app.state.hub.run)  # every followed stream, one reader
            tasks.start_soon(app.state.webhooks.run)  # the webhooks due, at least once each
            yield
            tasks.cancel_scope.cancel()
        await app.state.aredis.aclose(close_connection_pool=True)
        app.state.redis.close()

    # FastAPI's own /docs and /redoc load their JS and CSS from a CDN, blank offline: /docs
    # is served with the Swagger UI files of the swagger-ui-bundle-v2 package; no ReDoc.
    app = FastAPI(title="Fanout", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Batch text generation: submit a job, follow its stream, fetch results.")
    # Every router goes in with auth.authenticate: its routes need a key once keys exist.
    app.include_router(router, dependencies=[Depends(auth.authenticate)], tags=["jobs"],
                       responses={**UNAVAILABLE, **auth.RESPONSES})
    app.include_router(openai_router, dependencies=[Depends(auth.authenticate)], responses=OPENAI_ERRORS)
    app.include_router(anthropic_router, dependencies=[Depends(auth.authenticate)], responses=ANTHROPIC_ERRORS)
    app.include_router(webhooks.router, dependencies=[Depends(auth.authenticate)], responses={**UNAVAILABLE, **auth.RESPONSES})
    app.include_router(tokenize.router, dependencies=[Depends(auth.authenticate)], responses=OPENAI_ERRORS,
                       tags=["tokenizer"])
    app.include_router(fleet_router, dependencies=[Depends(auth.authenticate), Depends(auth.admin)], tags=["admin"],
                       responses={**UNAVAILABLE, **auth.RESPONSES, 403: {
                           "model": ErrorOut, "description": "an API key that is not an admin key"}})
    app.mount("/docs/static", StaticFiles(directory=swagger_ui_path), name="swagger-ui")
    # The jobs dashboard: static files from this package, open like /docs; every figure it
    # shows comes from the /v1 routes, with the key the user gives it (docs/ui.md).
    app.mount("/ui", StaticFiles(directory=UI, html=True), name="ui")

    @app.get("/docs", include_in_schema=False)
    def docs(request: Request):
        root = request.scope.get("root_path", "")  # behind a proxy that strips a prefix
        return get_swagger_ui_html(
            openapi_url=root + app.openapi_url, title=app.title + " - Swagger UI",
            swagger_js_url=f"{root}/docs/static/swagger-ui-bundle.js",
            swagger_css_url=f"{root}/docs/static/swagger-ui.css",
            swagger_favicon_url=f"{root}/docs/static/favicon-32x32.png")
    # Every 503 tells when to try again, whichever part answered it.
    app.add_middleware(RetryAfter)
    # A batch file upload has its own limit (FANOUT_BATCH_MAX_FILE_BYTES, and 1 MiB for the form).
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes,
                       paths={"/v1/files": settings.batch_max_file_bytes + 2**20})

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        if is_anthropic(request.url.path):
            return AnthropicError(400, from_validation(exc.errors()).message).response()
        if is_openai(request.url.path):
            return from_validation(exc.errors()).response()
        # Drop pydantic's union tags from locations: body.sampling_params.top_p, not
        # body.sampling_params.one.top_p.
        detail = []
        for e in exc.errors():
            e = {k: v for k, v in e.items() if k in ("loc", "msg", "type")}
            e["loc"] = [p for p in e.get("loc", ()) if p not in UNION_TAGS]
            detail.append(e)
        return JSONResponse({"detail": detail}, status_code=422)

    def unavailable_now(request: Request, message: str, code: str | None = None) -> JSONResponse:
        """A 503 in the route's format (RetryAfter adds its header)."""
        if is_anthropic(request.url.path):
            return AnthropicError(503, message).response()
        if is_openai(request.url.path):
            return OpenAIError(503, message, type="server_error", code=code).response()
        return JSONResponse({"detail": message}, status_code=503)

    async def redis_down(request: Request, exc: Exception):
        # The client learns that Redis is away or full, not where it lives: the log has the details.
        what = unavailable.describe(exc)
        return unavailable_now(request, f"{what} (ref {_logged(what, exc, stack=False)})")

    for error in unavailable.REDIS_DOWN:
        app.add_exception_handler(error, redis_down)

    @app.exception_handler(redis_url.PoolBusy)
    async def busy(request: Request, exc: redis_url.PoolBusy):
        # This process's connections to Redis are all in use (a burst of streams): not an outage.
        return unavailable_now(request, f"this API process is busy: {exc}; try again", "busy")

    @app.exception_handler(blobs.StoreError)
    async def store_down(request: Request, exc: blobs.StoreError):
        # As for Redis: what failed is in the log, under the ref.
        ref = _logged("blob store unavailable", exc, stack=False)
        return unavailable_now(request, f"blob store unavailable (ref {ref}); try again", "store_unavailable")

    @app.exception_handler(tenants.OverLimit)
    async def over_limit(request: Request, exc: tenants.OverLimit):
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
        if is_anthropic(request.url.path):
            return AnthropicError(429, exc.detail).response(headers)
        if is_openai(request.url.path):
            return OpenAIError(429, exc.detail, code=exc.limit).response(headers)
        return JSONResponse({"detail": exc.detail, "limit": exc.limit}, status_code=429, headers=headers)

    @app.exception_handler(streams.TooManyStreams)
    async def too_many_streams(request: Request, exc: streams.TooManyStreams):
        return unavailable_now(request, str(exc), "too_many_streams")

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError):
        if is_anthropic(request.url.path):  # a helper shared with the OpenAI routes raised it
            return AnthropicError(exc.status, exc.message).response()
        return exc.response()

    @app.exception_handler(AnthropicError)
    async def anthropic_error(request: Request, exc: AnthropicError):
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        # The OpenAI and Anthropic routes answer every error in their format (auth's 401, 403, 404, 405).
        if is_anthropic(request.url.path):
            return AnthropicError(exc.status_code, str(exc.detail)).response(exc.headers)
        if is_openai(request.url.path):
            return OpenAIError(exc.status_code, str(exc.detail)).response(exc.headers)
        return await http_exception_handler(request, exc)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        message = f"internal error (ref {_logged('unhandled error', exc)}): the API's log has the details"
        if is_anthropic(request.url.path):
            return AnthropicError(500, message).response()
        if is_openai(request.url.path):
            return OpenAIError(500, message, type="server_error").response()
        return JSONResponse({"detail": message}, status_code=500)

    @app.get("/healthz", response_model=Health, responses=UNAVAILABLE, tags=["admin"])
    @app.get("/health", response_model=Health, responses=UNAVAILABLE, tags=["admin"])  # vLLM's and SGLang's name
    def healthz(request: Request):
        """Liveness: the API is up and Redis takes writes (a full Redis still answers reads)."""
        try:
            request.app.state.redis.set(keys.healthz(), 1, px=10_000)
        except redis.RedisError as e:
            what = unavailable.describe(e)
            return JSONResponse({"detail": f"{what} (ref {_logged(what, e, stack=False)})"}, status_code=503)
        return {"status": "ok", "redis": "ok"}

    @app.get("/version", response_model=Version, tags=["admin"])
    def version():
        """This server's version (vLLM's and SGLang's route)."""
        return {"version": app.version}

    @app.get("/metrics", include_in_schema=False)
    def prometheus(request: Request):
        """Prometheus text exposition; open like /healthz (see api/metrics.py)."""
        return Response(metrics.exposition(request.app.state.redis), media_type=CONTENT_TYPE_LATEST)

    # The schema with the configured limits and runnable examples (api/openapi.py).
    app.openapi = lambda: openapi.build(app, settings, getattr(app.state, "redis", None))
    # Added last, so outermost: it counts every answer, those of the middleware above too.
    app.add_middleware(metrics.RequestMetrics, openapi=app.openapi)
    return app


def _logged(what: str, exc: Exception, stack: bool = True) -> str:
    """Log an error the client is not shown; returns the reference its answer carries."""
    ref = os.urandom(4).hex()
    logging.getLogger("fanout.api").error("%s (ref %s): %s: %s", what, ref, type(exc).__name__, exc,
                                          exc_info=exc if stack else None)
    return ref


class RetryAfter:
    """A 503 without a Retry-After header gets one (unavailable.RETRY_AFTER seconds), whichever
    part answered it: Redis away or full, the blob store, the stream cap, a tokenizer not yet
    published. (A 429 sets its own where waiting helps: tenants.OverLimit.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def sending(message):
            if message["type"] == "http.response.start" and message["status"] == 503:
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"retry-after" for k, _ in headers):
                    headers.append((b"retry-after", str(unavailable.RETRY_AFTER).encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, sending)


class BodyLimit:
    """A body over `limit` bytes (or its path's in `paths`) gets a 422 naming the body, like
    any other bad input (on the OpenAI routes a 400 in OpenAI's format): at once when
    Content-Length says so; a body sent without one is read up to the limit first (the JSON
    parser would hold it all anyway)."""

    def __init__(self, app, limit: int, paths: dict[str, int]):
        self.app, self.limit, self.paths = app, limit, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        limit = self.paths.get(scope["path"], self.limit)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit():
            if int(declared) > limit:
                return await self._reject(scope, receive, send, limit)
            return await self.app(scope, receive, send)
        buffered, seen = [], 0
        while True:
            message = await receive()
            buffered.append(message)
            seen += len(message.get("body", b""))
            if seen > limit:
                return await self._reject(scope, receive, send, limit)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay():
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope, receive, send, limit: int):
        msg = f"the body is over the limit of {limit} bytes (FANOUT_MAX_BODY_BYTES)"
        if scope["path"] in self.paths:
            msg = f"the body is over the limit of {limit} bytes (FANOUT_BATCH_MAX_FILE_BYTES + 1 MiB)"
        if is_openai(scope["path"]):
            return await OpenAIError(400, msg, code="body_too_large").response()(scope, receive, send)
        await JSONResponse({"detail": [{"loc": ["body"], "type": "body_too_large", "msg": msg}]},
                           status_code=422)(scope, receive, send)
