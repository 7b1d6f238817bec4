"""The gateway process: connections, the ASGI entry point, and the non-generation endpoints."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio as aioredis
import structlog
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from nats.aio.client import Client
from nats.js import JetStreamContext
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from inferbus.bus import connection as bus
from inferbus.openai.errors import (
    OpenAIError,
    http_exception_handler,
    openai_error_handler,
    unhandled_exception_handler,
    validation_exception_handler,
)
from inferbus.openai.json_body import JsonLimits
from inferbus.runtime import logs, redis_conn, tracing
from inferbus.stores.admission import Admission
from inferbus.stores.batches import BatchStore
from inferbus.stores.files import FileStore
from inferbus.stores.keys import KeyStore, Principal
from inferbus.stores.models import ModelCatalog
from inferbus.stores.pricing import Prices
from inferbus.stores.tenants import Tenant, TenantStore
from inferbus.tokens.prompt import ModelDirError, load_model

from . import openapi
from .admin import admin_router, require_admin
from .admin_adapters import adapters_router
from .batches_api import batches_router
from .console import Console, install_console
from .dispatch import Dispatcher
from .files_api import files_router
from .fleet import FleetMonitor
from .generation import ENDPOINTS, Generation
from .internal_api import InternalApi
from .overload import OverloadPolicy
from .releases import ReleaseRouting
from .responses_api import ResponsesAPI, responses_router
from .responses_store import ResponseStore
from .settings import GatewaySettings
from .usage_api import admin_usage_router, usage_router

log = logs.get(__name__)
_json = msgspec.json.Encoder()


class Gateway:
    """Connections shared by every endpoint: NATS, the dispatcher, Redis and the key store."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.gateway_id = settings.resolved_gateway_id()
        self.zone = settings.zone  # with INFERBUS_ZONE_FILE read at start()
        self.dispatcher: Dispatcher | None = None
        self.redis: aioredis.Redis | None = None
        self.admission: Admission | None = None
        self.generation: Generation | None = None
        self.responses: ResponsesAPI | None = None
        # How the platform's streams differ from what it needs (a missing ledger included): a /ready
        # problem for ops to fix (no service may reconfigure a stream), checked at start and again
        # by /ready. The `responses` bucket's retention or size limit differing from the settings
        # is reported too, and is no reason to stop serving.
        self.stream_drift: list[str] = []
        self.bucket_drift: list[str] = []
        self._drift_checked = -1e9  # monotonic time of the last check
        self.tenants: TenantStore | None = None
        self.fleet: FleetMonitor | None = None
        self.catalog: ModelCatalog | None = None
        self.files: FileStore | None = None
        self.batches: BatchStore | None = None
        self.internal_api: InternalApi | None = None
        self.js: JetStreamContext | None = None
        self.nc: Client | None = None
        self.console: Console | None = None  # the web console (/console), when INFERBUS_CONSOLE

    async def current_stream_drift(self, max_age_s: float = 5.0) -> list[str]:
        """The platform streams' drift, checked again when the last check is older than `max_age_s`."""
        now = time.monotonic()
        if self.js is not None and now - self._drift_checked >= max_age_s:
            self._drift_checked = now
            try:
                self.stream_drift = await bus.check_streams(self.js)
            except Exception as error:  # NATS away: its own /ready problem; keep the last answer
                log.warning("stream_check_failed", error=repr(error))
        return self.stream_drift

    async def _on_reconnect(self) -> None:
        if self.dispatcher is not None:
            self.dispatcher.reconnected()  # stream events sent while the connection was away are lost

    async def start(self) -> None:
        s = self.settings
        try:
            served = load_model(s.model_dir)  # before the bus: a misconfigured gateway stops at once
        except ModelDirError as error:
            raise SystemExit(f"gateway: {error}") from None
        self.zone = s.resolved_zone()  # before the bus too: a zone file that cannot be read stops it at once
        self.nc = await bus.connect(s.nats_url, name=f"gateway-{self.gateway_id}", on_reconnect=self._on_reconnect)
        js = self.js = self.nc.jetstream()
        self.stream_drift = await bus.ensure_streams(js)
        self._drift_checked = time.monotonic()
        workers = await bus.workers_bucket(js, s.heartbeat_ttl_s)
        overload = OverloadPolicy(clock=time.monotonic, budgets_s={
            "premium": s.queue_budget_premium_s, "standard": s.queue_budget_standard_s},
            start_window_s=s.start_lag_window_s)
        self.dispatcher = Dispatcher(
            self.nc, workers, gateway_id=self.gateway_id, heartbeat_ttl_s=s.heartbeat_ttl_s,
            max_attempts=s.max_attempts, placement_timeout_s=s.placement_timeout_ms / 1000,
            placement_patience_s=s.placement_patience_ms / 1000,
            window_per_worker=s.dispatch_window_per_worker, free_slots=overload.free_slots, block_size=s.block_size,
            worker_free_slots=overload.worker_free_slots, placement_fits=overload.placement_fits,
            on_started=overload.on_started,
            accept_timeout_s=s.accept_timeout_s, liveness_timeout_s=s.liveness_timeout_s,
            silence_s=s.stream_silence_s,
            outbox_path=Path(s.state_dir) / "usage-outbox-gateway.sqlite3", zone=self.zone,
        )
        await self.dispatcher.start()
        # Blocking pool: a burst waits up to 2 s for a connection instead of failing at the cap.
        self.redis = redis_conn.async_client(
            s.redis_url, max_connections=s.redis_max_connections, timeout=2, socket_timeout=2, socket_connect_timeout=2
        )
        self.tenants = TenantStore(self.redis)
        self.admission = admission = Admission(
            self.redis, on_redis_error=s.quota_on_redis_error, lease_ttl_s=s.lease_ttl_s  # type: ignore[arg-type]
        )
        prices = Prices(s.price_input_per_mtok, s.price_output_per_mtok, s.price_cached_input_per_mtok)
        self.fleet = FleetMonitor(self.nc, js, s.model, overload)
        await self.fleet.start()
        self.catalog = ModelCatalog(s.model, int(time.time()))
        await self.catalog.start(js)
        # The Files and Batch APIs: records in KV, file bytes on local (or shared) disk.
        batches_kv, files_kv = await bus.batch_buckets(js)
        files = FileStore(s.files_dir, files_kv, max_bytes=s.max_file_bytes)
        await asyncio.to_thread(files.sweep_temporary)
        self.files, self.batches = files, BatchStore(batches_kv)
        self.generation = Generation(s, self.dispatcher, KeyStore(self.redis, s.key_cache_ttl_s), self.tenants,
                                     admission, overload, prices, self.catalog, served)
        self.generation.releases = ReleaseRouting()
        await self.generation.releases.start(js)
        if s.internal_api:  # internal producers: the same calls over NATS request/reply
            self.internal_api = InternalApi(self.nc, self.generation, self.gateway_id)
            await self.internal_api.start()
        # The Responses API: stored responses in KV, generation through the chat path above.
        store = await ResponseStore.open(js, s.responses_retention_s, s.responses_max_bytes)
        self.bucket_drift = store.drift
        self.responses = ResponsesAPI(self.generation, store)
        if s.console:
            self.console = Console(s, self.redis, self.generation.keys, self.nc, js)
            await self.console.start()
        log.info("gateway_ready", gateway_id=self.gateway_id, host=s.host, port=s.port, model=s.model, zone=self.zone)

    async def stop(self) -> None:
        if self.console is not None:
            await self.console.stop()
        if self.internal_api is not None:
            await self.internal_api.stop()
        if self.catalog is not None:
            await self.catalog.stop()
        if self.generation is not None and self.generation.releases is not None:
            await self.generation.releases.stop()
        if self.fleet is not None:
            await self.fleet.stop()
        if self.dispatcher is not None:
            await self.dispatcher.stop()
        if self.nc is not None:
            await self.nc.drain()
        if self.admission is not None:
            await self.admission.aclose()
        if self.redis is not None:
            await self.redis.aclose()


class GatewayASGI:
    """Generation requests go straight to `Generation`; everything else to the FastAPI app."""

    def __init__(self, api: FastAPI, gateway: Gateway) -> None:
        self.api = api
        self.gateway = gateway

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and self.gateway.generation is not None:
            endpoint = ENDPOINTS.get(scope["path"].rstrip("/"))
            if endpoint is not None:
                return await self.gateway.generation(scope, receive, send, endpoint)
            if scope["path"].rstrip("/") == "/v1/responses" and self.gateway.responses is not None:
                return await self.gateway.responses.create(scope, receive, send)
        await self.api(scope, receive, send)


class RequestIdMiddleware:
    """Give every other HTTP request an id (`x-request-id`, the SDK's `request_id`) and bind it to logs."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                message["headers"] = [*headers, header]
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(settings: GatewaySettings) -> GatewayASGI:
    gateway = Gateway(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        yield
        await gateway.stop()

    api = FastAPI(title="inferbus gateway", version="0.1.0", lifespan=lifespan)
    api.state.gateway = gateway
    api.state.json_limits = JsonLimits(max_depth=settings.max_json_depth, max_bytes=settings.max_body_bytes)
    api.add_middleware(RequestIdMiddleware)
    api.add_exception_handler(OpenAIError, openai_error_handler)
    api.add_exception_handler(StarletteHTTPException, http_exception_handler)
    api.add_exception_handler(RequestValidationError, validation_exception_handler)
    api.add_exception_handler(Exception, unhandled_exception_handler)
    if settings.admin_key:  # no key, no admin API: its URLs are plain 404s
        api.include_router(admin_router(settings.admin_key, lambda: gateway.tenants), prefix="/admin/v1")
        api.include_router(adapters_router(settings.admin_key, settings.model, lambda: gateway.js), prefix="/admin/v1")

    async def identity(request: Request) -> tuple[Principal, Tenant]:
        if gateway.generation is None:
            raise OpenAIError(503, "The gateway is starting; retry shortly.", code="service_unavailable",
                              headers={"retry-after": "1"})
        principal = await gateway.generation._authenticate(request.headers.get("authorization"))
        return principal, await gateway.generation.tenant(principal)

    async def caller(request: Request) -> Tenant:
        return (await identity(request))[1]

    # Usage and costs: /v1/usage, /v1/costs; /admin/v1/usage, /admin/v1/costs, /admin/v1/prices.
    api.include_router(usage_router(lambda: gateway.generation, lambda: gateway.redis))
    if settings.admin_key:
        api.include_router(admin_usage_router(settings.admin_key, lambda: gateway.redis), prefix="/admin/v1")

    # Files and batches: /v1/files, /v1/batches.
    api.include_router(files_router(identity, lambda: gateway.files))
    api.include_router(batches_router(identity, lambda: gateway.batches, lambda: gateway.files))

    # The Responses API's stored responses: GET/DELETE /v1/responses/{id}, .../input_items.
    api.include_router(responses_router(identity, lambda: gateway.responses))

    @api.get("/v1/models")
    async def list_models(request: Request) -> Response:
        tenant = await caller(request)
        assert gateway.catalog is not None
        return Response(
            _json.encode({"object": "list", "data": gateway.catalog.cards(tenant)}), media_type="application/json"
        )

    @api.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> Response:
        tenant = await caller(request)
        assert gateway.catalog is not None
        await gateway.catalog.lookup(model_id, tenant)
        return Response(_json.encode(gateway.catalog.card(model_id)), media_type="application/json")

    @api.get("/health")
    async def health() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @api.get("/ready")
    async def ready() -> Response:
        problems = []
        if gateway.nc is None or not gateway.nc.is_connected:
            problems.append("nats")
        try:
            assert gateway.redis is not None
            await gateway.redis.ping()
        except Exception:
            problems.append("redis")
        if gateway.js is not None and gateway.nc is not None and gateway.nc.is_connected:
            # A deleted ledger stream or bucket is not recreated under a running gateway: say so.
            problems += [f"missing_{store}" for store in await bus.missing_stores(gateway.js)]
        # Without a worker whose engine serves, every generation would be a 503: take this replica
        # out of the load balancer until one is back (a worker whose engine is down is not ready).
        workers = len(gateway.dispatcher.live_workers) if gateway.dispatcher else 0
        if gateway.dispatcher is None or not gateway.dispatcher.has_workers(settings.model):
            problems.append("no_workers")
        stream_drift = await gateway.current_stream_drift()
        if stream_drift:
            problems.append("stream_config_drift")
        body = {"status": "ready" if not problems else "not_ready", "problems": problems, "workers": workers,
                "stream_drift": stream_drift + gateway.bucket_drift}
        return Response(_json.encode(body), status_code=200 if not problems else 503, media_type="application/json")

    @api.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    if settings.console:  # the web console: /console (docs/console.md)
        install_console(api, gateway)

    # The public document leaves the admin API out; admins read theirs with the admin key.
    openapi.install(api)
    if settings.admin_key:

        @api.get(
            "/admin/openapi.json", include_in_schema=False, dependencies=[Depends(require_admin(settings.admin_key))]
        )
        async def admin_openapi() -> Response:
            return Response(_json.encode(openapi.admin_document(api)), media_type="application/json")

    return GatewayASGI(api, gateway)


def serve(settings: GatewaySettings) -> None:
    import uvicorn

    logs.configure("gateway", settings.log_level)
    tracing.configure("gateway", settings.otel_exporter)
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, loop="uvloop", http="httptools",
        access_log=False, log_level="warning", timeout_graceful_shutdown=10, lifespan="on",
        timeout_keep_alive=settings.keep_alive_s,
    )
