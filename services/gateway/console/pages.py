"""The console's pages: server-rendered HTML (Jinja2) with Chart.js charts, under /console.

Tenant pages (a tenant's session or API key): usage and cost, API keys, limits, batches and files,
adapters. Operator pages (the admin key): SLOs and overload, the fleet, tenants and prices,
releases and canaries, the autoscaler. Every tenant page reads the viewer's own tenant only; no
URL names a tenant.
"""

from __future__ import annotations

import datetime as dt
import io
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import msgspec
import redis.asyncio as aioredis
from fastapi import APIRouter, FastAPI, Request
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse, RedirectResponse, Response

from inferbus.openai.errors import unhandled_exception_handler
from inferbus.releases import record
from inferbus.releases import store as release_store
from inferbus.runtime import logs
from inferbus.stores import usage as u
from inferbus.stores.admission import read_quota
from inferbus.stores.billing import PriceStore, UsageStore
from inferbus.stores.keys import issue_key, list_keys, revoke_key, tenant_key
from inferbus.stores.pricing import effective_versions
from inferbus.stores.tenants import Tenant, valid_tenant_id
from inferbus.stores.usage_export import collect_rows, write_rows
from proto import messages as m

from . import slo, usage_view
from .auth import (
    COOKIE_PATH,
    LOGIN_COOKIE,
    SESSION_COOKIE,
    Forbidden,
    NotSignedIn,
    Viewer,
    check_csrf,
    check_login_csrf,
)
from .live import WorkerSeen
from .recorder import read_minutes

if TYPE_CHECKING:
    from .parts import GatewayParts
    from .service import Console

log = logs.get(__name__)
HERE = Path(__file__).parent
MAX_KEY_NAME = 100
# Content-Security-Policy: scripts and styles from the console's own files only (chart data
# travels as inline JSON data blocks, which are never executed), no framing, forms post here only.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "font-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "content-security-policy": CSP, "x-content-type-options": "nosniff", "x-frame-options": "DENY",
    "referrer-policy": "same-origin", "cache-control": "no-store",
}


class PageError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# ---- formatting ----------------------------------------------------------------------------------

def _num(value: Any) -> str:
    return "–" if value is None else f"{value:,}"


def _usd_micro(micro: int) -> str:
    return "$" + u.usd_text(micro)


def _pct(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value * 100:.{digits}f}%"


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:,.0f} ms"


def _when(ts: float | None) -> str:
    if not ts:
        return "–"
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _ago(ts: float | None, now: float | None = None) -> str:
    if not ts:
        return "never"
    seconds = max(0.0, (now or time.time()) - ts)
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.1f} h ago"
    return f"{seconds / 86400:.0f} days ago"


def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(num=_num, usd=_usd_micro, pct=_pct, ms=_ms, when=_when, ago=_ago, short=record.short)
    return env


# ---- the router ------------------------------------------------------------------------------------

def install(api: FastAPI, gateway: GatewayParts) -> None:
    """Mount the console at /console on the gateway's app (its pages answer 503 until it started)."""
    env = environment()
    api.mount("/console/static", StaticFiles(directory=HERE / "static"), name="console-static")
    api.include_router(console_router(gateway, env))

    @api.exception_handler(NotSignedIn)
    async def not_signed_in(request: Request, error: NotSignedIn) -> Response:
        if request.headers.get("authorization") or request.url.path.endswith(".csv"):
            return Response(
                "Sign in first: send `Authorization: Bearer <API key>` or use the console's sign-in page.\n",
                status_code=401,
                media_type="text/plain",
                headers=SECURITY_HEADERS,
            )
        target = "/console/login"
        if request.method == "GET" and request.url.path not in ("/console", "/console/"):
            target += "?next=" + request.url.path
        response = RedirectResponse(target, status_code=303, headers=SECURITY_HEADERS)
        response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH)
        return response

    @api.exception_handler(Forbidden)
    async def forbidden(request: Request, error: Forbidden) -> Response:
        return _render(env, request, "error.html", {"viewer": None, "status": 403, "message": error.message}, 403)

    @api.exception_handler(PageError)
    async def page_error(request: Request, error: PageError) -> Response:
        return _render(env, request, "error.html", {"viewer": None, "status": error.status, "message": error.message},
                       error.status)

    @api.exception_handler(aioredis.RedisError)
    async def storage_error(request: Request, error: aioredis.RedisError) -> Response:
        if not request.url.path.startswith("/console"):
            return await unhandled_exception_handler(request, error)  # as before: the API's own 500
        log.error("console_storage_failed", error=repr(error))
        return _render(
            env,
            request,
            "error.html",
            {
                "viewer": None,
                "status": 503,
                "message": "The platform's store (Redis) is unavailable; reload in a moment.",
            },
            503,
        )


def _render(env: jinja2.Environment, request: Request, template: str, context: dict[str, Any],
            status: int = 200) -> HTMLResponse:
    html = env.get_template(template).render(path=request.url.path, now=time.time(), **context)
    return HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)


def console_router(gateway: GatewayParts, env: jinja2.Environment) -> APIRouter:
    router = APIRouter(prefix="/console", include_in_schema=False)

    def console() -> Console:
        found = gateway.console
        if found is None:
            raise PageError(503, "The gateway is starting; reload in a moment.")
        return found

    def redis() -> aioredis.Redis:
        assert gateway.redis is not None
        return gateway.redis

    async def viewer(request: Request, role: str) -> Viewer:
        seen = await console().sessions.viewer(request)
        if role == "tenant" and seen.admin:
            raise PageError(403, "This is a tenant's page: operators see tenants under Operator → Tenants.")
        if role == "admin" and not seen.admin:
            raise PageError(403, "This page is for operators: sign in with the admin key.")
        return seen

    async def tenant_of(v: Viewer) -> Tenant:
        assert gateway.tenants is not None
        found = await gateway.tenants.fetch(v.tenant)
        if found is None:
            raise PageError(404, f"Tenant `{v.tenant}` no longer exists.")
        return found

    def page(request: Request, template: str, v: Viewer | None, status: int = 200, **context: Any) -> HTMLResponse:
        return _render(env, request, template, {"viewer": v, **context}, status)

    # ---- signing in and out ------------------------------------------------------------------------

    @router.get("")
    @router.get("/")
    async def home(request: Request) -> Response:
        v = await console().sessions.viewer(request)
        return RedirectResponse("/console/ops" if v.admin else "/console/usage", status_code=303)

    @router.get("/login")
    async def login_form(request: Request, next: str = "") -> Response:
        token = secrets.token_urlsafe(32)
        response = page(request, "login.html", None, login_token=token, next=_safe_next(next), error="")
        _set_cookie(response, request, LOGIN_COOKIE, token, max_age=1800)
        return response

    @router.post("/login")
    async def login(request: Request) -> Response:
        form = await request.form()
        check_login_csrf(request, _text(form.get("csrf_token")))
        session = await console().sessions.identify(_text(form.get("key")) or "")
        response: Response
        if session is None:
            token = secrets.token_urlsafe(32)
            response = page(
                request,
                "login.html",
                None,
                401,
                login_token=token,
                next=_safe_next(_text(form.get("next"))),
                error="That key is not valid here: use one of your API keys, or the admin key.",
            )
            _set_cookie(response, request, LOGIN_COOKIE, token, max_age=1800)
            return response
        session_id = await console().sessions.open(session)
        log.info("console_sign_in", role=session.role, tenant=session.tenant or None, key_id=session.key_id or None)
        default = "/console/ops" if session.role == "admin" else "/console/usage"
        target = _safe_next(_text(form.get("next"))) or default
        if (session.role == "admin") != target.startswith("/console/ops"):
            target = default
        response = RedirectResponse(target, status_code=303, headers=SECURITY_HEADERS)
        _set_cookie(response, request, SESSION_COOKIE, session_id, max_age=None)
        response.delete_cookie(LOGIN_COOKIE, path=COOKIE_PATH)
        return response

    @router.post("/logout")
    async def logout(request: Request) -> Response:
        v = await console().sessions.viewer(request)
        form = await request.form()
        check_csrf(request, v, _text(form.get("csrf_token")))
        if v.session_id:
            await console().sessions.close(v.session_id)
        response = RedirectResponse("/console/login", status_code=303, headers=SECURITY_HEADERS)
        response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH)
        return response

    # ---- tenant: usage and cost --------------------------------------------------------------------

    async def usage_rows(tenant: str, win: usage_view.Window, bucket: str) -> list[dict[str, Any]]:
        """The rows `inferbus usage export --tenant <tenant> --from <first day> --to <end day>` writes."""
        try:
            rows = await collect_rows(UsageStore(redis()), [tenant], win.start, win.end, bucket, u.EXPORT_GROUP_BY)
        except aioredis.RedisError as error:
            raise PageError(503, f"Usage data (Redis) is unavailable: {error}") from None
        return usage_view.rows_of_tenant(rows, tenant)  # type: ignore[return-value]

    def window_of(request: Request) -> usage_view.Window:
        try:
            return usage_view.window(request.query_params.get("from"), request.query_params.get("to"), time.time())
        except usage_view.WindowError as error:
            raise PageError(400, str(error)) from None

    async def usage_page(request: Request, v: Viewer, tenant: str, base: str) -> Response:
        win = window_of(request)
        rows = await usage_rows(tenant, win, "1d")
        names = {key.id: key.name for key in await list_keys(redis(), tenant)}
        summary = usage_view.summarize(rows, win, names)
        return page(request, "usage.html", v, summary=summary, dimensions=usage_view.DIMENSIONS, tenant=tenant,
                    base=base, command=win.export_command(tenant, "1d"), csv_command=win.export_command(tenant, "1h"))

    async def usage_csv_of(request: Request, tenant: str) -> Response:
        win = window_of(request)
        bucket = request.query_params.get("bucket", "1h")
        if bucket not in ("1h", "1d"):
            raise PageError(400, "`bucket` is 1h or 1d.")
        rows = await usage_rows(tenant, win, bucket)
        out = io.BytesIO()
        write_rows(rows, "csv", out)
        name = f"usage-{tenant}-{win.first_day}-{win.last_day}-{bucket}.csv"
        return Response(out.getvalue(), media_type="text/csv; charset=utf-8",
                        headers={**SECURITY_HEADERS, "content-disposition": f'attachment; filename="{name}"'})

    @router.get("/usage")
    async def usage(request: Request) -> Response:
        v = await viewer(request, "tenant")
        return await usage_page(request, v, v.tenant, "/console/usage")

    @router.get("/usage.csv")
    async def usage_csv(request: Request) -> Response:
        v = await viewer(request, "tenant")
        return await usage_csv_of(request, v.tenant)

    # An operator reads any tenant's page (and `_platform`'s, the abandoned attempts), the same way.
    def tenant_param(tenant_id: str) -> str:
        if tenant_id != u.PLATFORM_ACCOUNT and not valid_tenant_id(tenant_id):
            raise PageError(404, f"No tenant `{tenant_id}`.")
        return tenant_id

    @router.get("/ops/tenants/{tenant_id}/usage")
    async def tenant_usage(tenant_id: str, request: Request) -> Response:
        v = await viewer(request, "admin")
        tenant = tenant_param(tenant_id)
        return await usage_page(request, v, tenant, f"/console/ops/tenants/{tenant}/usage")

    @router.get("/ops/tenants/{tenant_id}/usage.csv")
    async def tenant_usage_csv(tenant_id: str, request: Request) -> Response:
        await viewer(request, "admin")
        return await usage_csv_of(request, tenant_param(tenant_id))

    # ---- tenant: API keys --------------------------------------------------------------------------

    async def keys_page(
        request: Request, v: Viewer, created: Any = None, status: int = 200, error: str = ""
    ) -> Response:
        keys = await list_keys(redis(), v.tenant)
        return page(request, "keys.html", v, status, keys=keys, created=created, error=error)

    @router.get("/keys")
    async def keys(request: Request) -> Response:
        v = await viewer(request, "tenant")
        return await keys_page(request, v)

    @router.post("/keys")
    async def create_key(request: Request) -> Response:
        v = await viewer(request, "tenant")
        form = await request.form()
        check_csrf(request, v, _text(form.get("csrf_token")))
        name = (_text(form.get("name")) or "").strip()
        if len(name) > MAX_KEY_NAME:
            return await keys_page(request, v, status=400, error=f"A key's name is at most {MAX_KEY_NAME} characters.")
        issued = await issue_key(redis(), v.tenant, name)
        log.info("api_key_created", tenant=v.tenant, key_id=issued.id, via="console")
        # The only time the secret is shown: in this response, never stored, never rendered again.
        return await keys_page(request, v, created=issued, status=201)

    @router.post("/keys/{key_id}/revoke")
    async def revoke(key_id: str, request: Request) -> Response:
        v = await viewer(request, "tenant")
        form = await request.form()
        check_csrf(request, v, _text(form.get("csrf_token")))
        raw = await redis().hget(tenant_key(v.tenant, "keys"), key_id)
        if raw is None or not await revoke_key(redis(), v.tenant, key_id):
            raise PageError(404, f"Your tenant has no key `{key_id}`.")
        digest = msgspec.json.decode(raw).get("hash", "")
        if gateway.generation is not None and digest:
            gateway.generation.keys.forget(digest)  # this gateway refuses it at once; others within their cache TTL
        log.info("api_key_revoked", tenant=v.tenant, key_id=key_id, via="console")
        return RedirectResponse("/console/keys", status_code=303, headers=SECURITY_HEADERS)

    # ---- tenant: limits, batches and files, adapters ------------------------------------------------

    @router.get("/limits")
    async def limits(request: Request) -> Response:
        v = await viewer(request, "tenant")
        tenant = await tenant_of(v)
        uses = await read_quota(redis(), v.tenant, tenant.limits)
        return page(request, "limits.html", v, tenant=tenant, uses=uses)

    @router.get("/batches")
    async def batches(request: Request) -> Response:
        v = await viewer(request, "tenant")
        if gateway.batches is None or gateway.files is None:
            raise PageError(503, "The gateway is starting; reload in a moment.")
        found, more_batches = await gateway.batches.list(v.tenant, limit=100)
        files, more_files = await gateway.files.list(v.tenant, limit=100)
        return page(request, "batches.html", v, batches=found, files=files, more_batches=more_batches,
                    more_files=more_files)

    @router.get("/adapters")
    async def adapters(request: Request) -> Response:
        v = await viewer(request, "tenant")
        tenant = await tenant_of(v)
        catalog = gateway.catalog
        assert catalog is not None
        rollouts = gateway.generation.releases.rollouts if gateway.generation and gateway.generation.releases else None
        specs = sorted((spec for name, spec in catalog.adapters.items() if catalog.visible(tenant, name)),
                       key=lambda spec: spec.name)
        rows = [(spec, rollouts.adapter(spec.name) if rollouts else None) for spec in specs]
        return page(request, "adapters.html", v, rows=rows)

    # ---- operator ------------------------------------------------------------------------------------

    @router.get("/ops")
    async def ops(request: Request) -> Response:
        v = await viewer(request, "admin")
        c = console()
        now = time.time()
        minutes = await read_minutes(redis(), int(now) - 86400 - 900, int(now) + 60)
        view = slo.day_view(minutes, now, c.budgets)
        policy = gateway.fleet.policy if gateway.fleet is not None else None
        overload = []
        if policy is not None:
            for band, budget in policy.budgets_s.items():
                wait = policy.expected_wait_s(band)
                overload.append(
                    {
                        "band": band,
                        "budget_s": budget,
                        "wait_s": wait,
                        "queued": policy._queued.get(band, 0),
                        "shedding": wait > budget,
                    }
                )
        states = [c.live.worker_state(seen, now) for seen in c.live.workers.values()]
        return page(request, "ops.html", v, view=view, budgets=c.budgets, chart=slo.chart(view, c.budgets),
                    overload=overload, free_slots=policy.free_slots() if policy else None,
                    rate=policy.completion_rate() if policy else None,
                    workers={state: states.count(state) for state in sorted(set(states))})

    @router.get("/ops/fleet")
    async def fleet(request: Request) -> Response:
        v = await viewer(request, "admin")
        c = console()
        now = time.time()
        rows = []
        for worker_id, seen in sorted(c.live.workers.items(), key=lambda item: (item[1].heartbeat.zone, item[0])):
            state = c.live.worker_state(seen, now)
            load = c.live.load_of(worker_id) if state not in ("gone", "silent") else None  # no stale numbers
            kv = load.kv_used_tokens / load.kv_capacity_tokens if load and load.kv_capacity_tokens else None
            rows.append(FleetRow(worker_id, seen.heartbeat, seen, state, load, kv))
        groups: dict[tuple[str, str, str], int] = {}
        for row in rows:
            if row.state in ("ready", "starting", "draining"):
                key = (row.beat.zone or "(none)", row.beat.role, _bands_of(row.beat))
                groups[key] = groups.get(key, 0) + 1
        drawn = [row for row in rows if row.kv is not None]
        chart = {"labels": [row.id for row in drawn],
                 "datasets": [{"label": "KV cache used (%)", "data": [round((row.kv or 0) * 100, 2) for row in drawn]}]}
        return page(request, "fleet.html", v, rows=rows, groups=sorted(groups.items()), chart=chart,
                    ttl=gateway.settings.heartbeat_ttl_s)

    @router.get("/ops/tenants")
    async def tenants(request: Request) -> Response:
        v = await viewer(request, "admin")
        assert gateway.tenants is not None
        now = time.time()
        found = await gateway.tenants.list()
        month_start = usage_view.window(None, None, now).start
        spend = await _month_costs(redis(), month_start, now)
        quotas = {t.id: await read_quota(redis(), t.id, t.limits) for t in found}
        _, book = await PriceStore(redis()).load()
        in_force = {p.field() for p in effective_versions(book, now)}
        prices = [(p, p.field() in in_force) for p in book.versions]
        return page(request, "tenants.html", v, tenants=found, spend=spend, quotas=quotas, prices=prices,
                    platform_cost=spend.get(u.PLATFORM_ACCOUNT))

    @router.get("/ops/releases")
    async def releases(request: Request) -> Response:
        v = await viewer(request, "admin")
        c = console()
        routing = gateway.generation.releases if gateway.generation else None
        current: list[m.Rollout] = []
        histories: dict[str, list[m.Rollout]] = {}
        if routing is not None and routing.rollouts.kv is not None:
            kv = routing.rollouts.kv
            for model, rollout in sorted(routing.rollouts.by_model.items()):
                current.append(rollout)
                histories[model] = (await release_store.rollout_history(kv, model))[::-1]
            for adapter, rollout in sorted(routing.rollouts.by_adapter.items()):
                current.append(rollout)
                histories[adapter] = (await release_store.rollout_history(kv, rollout.model, adapter))[::-1]
        decisions = list(reversed(c.live.releases))
        return page(request, "releases.html", v, rollouts=current, histories=histories, decisions=decisions)

    @router.get("/ops/autoscaler")
    async def autoscaler(request: Request) -> Response:
        v = await viewer(request, "admin")
        c = console()
        decisions = list(c.live.scale)
        pools = sorted({d.pool for d in decisions})
        latest = {pool: next(d for d in reversed(decisions) if d.pool == pool) for pool in pools}
        changes = [d for d in reversed(decisions) if d.direction != "hold" or d.promote or d.demote][:50]
        chart = {pool: {"labels": [dt.datetime.fromtimestamp(d.ts, dt.timezone.utc).strftime("%H:%M:%S")
                                   for d in decisions if d.pool == pool],
                        "datasets": [{"label": "serving", "data": [d.serving for d in decisions if d.pool == pool]},
                                     {"label": "desired serving",
                                      "data": [d.desired_serving for d in decisions if d.pool == pool]},
                                     {"label": "warm", "data": [d.warm for d in decisions if d.pool == pool]}]}
                 for pool in pools}
        return page(
            request,
            "autoscaler.html",
            v,
            latest=latest,
            changes=changes,
            recent=list(reversed(decisions))[:30],
            chart=chart,
        )

    return router


@dataclass
class FleetRow:
    id: str
    beat: m.Heartbeat
    seen: WorkerSeen
    state: str
    load: m.WorkerLoad | None
    kv: float | None  # share of the KV cache in use


def _bands_of(beat: m.Heartbeat) -> str:
    """The bands a worker pulls, as its heartbeat says (older workers do not say)."""
    return ", ".join(beat.bands) if beat.bands else "(not reported)"


async def _month_costs(redis: aioredis.Redis, start: int, now: float) -> dict[str, Any]:
    """This month's usage per tenant (`_platform` included) from the daily rollups: requests,
    tokens and micro-dollars, as `/admin/v1/usage?group_by=tenant` reads them."""
    store = UsageStore(redis)
    epoch = await store.state.epoch()
    query = u.UsageQuery(start=start, end=u.ceil_to(now, 86400), width="1d", group_by=("tenant",), limit=31)
    totals: dict[str, u.Totals] = {}
    while True:
        buckets, cursor = await store.query(query, None, epoch)
        for _, groups in buckets:
            for (tenant,), t in groups.items():
                totals.setdefault(tenant, u.Totals()).add(t)
        if cursor is None:
            break
        query = u.UsageQuery(start=query.start, end=query.end, width="1d", group_by=query.group_by, limit=31,
                             page=u.decode_cursor(cursor))
    return totals


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _safe_next(target: str | None) -> str:
    """Only a path of the console itself (no open redirect)."""
    if target and target.startswith("/console/") and not target.startswith("//") and "\\" not in target:
        return target
    return ""


def _set_cookie(response: Response, request: Request, name: str, value: str, max_age: int | None) -> None:
    response.set_cookie(name, value, max_age=max_age, path=COOKIE_PATH, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")

