"""`inferbus usage …` and `inferbus prices …`: billing's commands, registered on the main CLI by
`register` (called from tools/commands/main.py).

`usage` commands work on the billing records directly (REDIS_URL, and NATS_URL for a rebuild):
they are what an operator runs next to the billing service. Without either, they use the local
platform `inferbus up` runs (`local_platform`), and say which one they use. `prices` goes through the gateway's
admin API, like `tenants` and `keys`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

GROUP_BY_DEFAULT = "model,adapter,band,api_key,batch_id,release"


def parse_time(text: str) -> float:
    """Unix seconds from an ISO 8601 date or time (UTC unless it has an offset) or unix seconds."""
    from services.gateway.usage_api import parse_time as parse

    return parse(text)


class _Time(click.ParamType):
    name = "TIME"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, float):
            return value
        try:
            return parse_time(str(value))
        except ValueError as error:
            self.fail(f"{error} (e.g. 2026-10-01, 2026-10-01T12:00:00Z or 1790812800)", param, ctx)


TIME = _Time()


def _redis_option(command: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--redis-url",
        envvar="REDIS_URL",
        default=None,
        help="Redis of the billing service (env REDIS_URL; with a password: redis://:PASSWORD@HOST:PORT/0, "
        "TLS: rediss://). Default: the local platform `inferbus up` runs from "
        "INFERBUS_PLATFORM_DIR (.inferbus), else redis://127.0.0.1:6379/0.",
    )(command)


def _redis(given: str | None) -> str:
    """The Redis to use, saying which on standard error."""
    from tools.commands import local_platform

    choice = local_platform.redis_url(given)
    click.echo(choice.note, err=True)
    return choice.value


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _billing_settings() -> Any:
    from inferbus.runtime import settings as settings_mod
    from services.billing.settings import BillingSettings

    return settings_mod.load(BillingSettings)


def register(main: click.Group, admin_api: type, admin_options: Callable[..., Any],
             table: Callable[[list[str], list[list[str]]], str]) -> None:
    """Add the `usage` and `prices` groups to `main`."""

    @main.group()
    def usage() -> None:
        """Usage records: exports, monthly exports and rebuilding rollups from the ledger.

        These work on the billing service's records directly: Redis (--redis-url, env REDIS_URL) and,
        for a rebuild, NATS (--nats-url, env NATS_URL). Without them they use the local platform that
        `inferbus up` runs from INFERBUS_PLATFORM_DIR (default .inferbus), and say so. Tenants read
        their own usage with GET /v1/usage and /v1/costs; operators with /admin/v1/usage and
        /admin/v1/costs.
        """

    @usage.command("export")
    @click.option("--tenant", "tenants", multiple=True, metavar="ID",
                  help="Tenant to export (repeatable); default: every tenant with usage.")
    @click.option("--from", "start", required=True, type=TIME,
                  help="Start, inclusive: ISO 8601 (UTC unless an offset is given) or unix seconds.")
    @click.option("--to", "end", default=None, type=TIME, help="End, exclusive (default: now).")
    @click.option("--bucket", default="1h", show_default=True, type=click.Choice(["1m", "1h", "1d"]),
                  help="Width of a row's time bucket (UTC; 1m buckets are kept 48 h by default).")
    @click.option("--group-by", default=GROUP_BY_DEFAULT, show_default=True, metavar="A,B",
                  help="Dimensions of a row: model, adapter, band, api_key, batch (yes/no), batch_id, release "
                       "(the release that served the requests, `inferbus release`; empty: unpinned workers).")
    @click.option("--format", "fmt", default="csv", show_default=True, type=click.Choice(["csv", "jsonl", "parquet"]))
    @click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
                  help="File to write (default: standard output; parquet needs a file).")
    @_redis_option
    def usage_export(tenants: tuple[str, ...], start: float, end: float | None, bucket: str, group_by: str, fmt: str,
                     out: Path | None, redis_url: str | None) -> None:
        """Write usage as one row per time bucket and group, with tokens and dollars.

        Columns: tenant, start_time, end_time, bucket_start, model, adapter, band, api_key_id,
        batch_id, release, num_model_requests, num_cancelled_requests, num_failed_requests, input_tokens
        (cached included), input_cached_tokens, output_tokens, the micro-dollars of each token kind,
        cost_micro_usd and cost_usd (exact, 6 decimals). Empty buckets have no row.
        """
        from inferbus.stores import usage as u
        from inferbus.stores.usage_export import collect_rows, write_rows

        if fmt == "parquet" and out is None:
            raise click.UsageError("--format parquet needs --out FILE")
        end = time.time() if end is None else end
        if end <= start:
            raise click.UsageError("--to must be after --from")
        try:
            dims = u.resolve_group_by(_split(group_by))
        except u.QueryError as error:
            raise click.UsageError(str(error)) from None

        redis_url = _redis(redis_url)

        async def run() -> list[dict[str, Any]]:
            store = await _store(redis_url)
            try:
                chosen = list(tenants) or await store.tenants()
                width = u.WIDTHS[bucket]
                buckets = (u.ceil_to(end, width) - u.floor_to(start, width)) // width * max(1, len(chosen))
                with click.progressbar(length=buckets, label="Reading usage", file=sys.stderr,
                                       show_pos=True) as bar:
                    return await collect_rows(store, chosen, int(start), math.ceil(end), bucket, dims, bar.update)
            finally:
                await store.redis.aclose()

        rows = asyncio.run(run())
        if out is None:
            write_rows(rows, fmt, sys.stdout.buffer)
            sys.stdout.flush()
        else:
            write_rows(rows, fmt, out)
        if not rows:
            who = ", ".join(tenants) if tenants else "any tenant"
            click.echo(f"No usage found for {who} from {_iso(start)} to {_iso(end)} in this Redis: check the tenant "
                       "id, --from/--to, and that this is the platform that served the requests (above).", err=True)
        total = sum(r["cost_micro_usd"] for r in rows)
        click.echo(f"{len(rows)} rows, {sum(r['input_tokens'] for r in rows):,} input and "
                   f"{sum(r['output_tokens'] for r in rows):,} output tokens, ${u.usd_text(total)}"
                   + (f" -> {out}" if out else ""), err=True)

    @usage.command("export-month")
    @click.option("--month", required=True, metavar="YYYY-MM", help="UTC calendar month to export.")
    @click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path), default=None,
                  help="Directory (default INFERBUS_EXPORT_DIR, else the local platform's `exports` in its state "
                       "dir); files go to <dir>/<month>/<tenant>.<format>.")
    @click.option("--format", "fmt", default=None, type=click.Choice(["csv", "jsonl", "parquet"]),
                  help="Default INFERBUS_EXPORT_FORMAT (csv).")
    @click.option(
        "--bucket", default=None, type=click.Choice(["1h", "1d"]), help="Default INFERBUS_EXPORT_BUCKET (1h)."
    )
    @click.option("--tenant", "tenants", multiple=True, metavar="ID",
                  help="Only these tenants (repeatable); the month is then not marked as exported.")
    @click.option("--force", is_flag=True, help="Write the files again even if the month is marked as exported.")
    @_redis_option
    def usage_export_month(month: str, directory: Path | None, fmt: str | None, bucket: str | None,
                           tenants: tuple[str, ...], force: bool, redis_url: str | None) -> None:
        """Write one month's usage file per tenant, as the billing service does on its own.

        The billing service exports last month once, in the first hour of a new month (after
        INFERBUS_EXPORT_DELAY_S), and marks it in Redis; this does the same by hand, and skips a
        month already marked unless --force.
        """
        from services.billing.export import export_month, month_range
        from tools.commands import local_platform

        try:
            month_range(month)
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="--month") from None
        settings = _billing_settings()
        # The platform's own export directory (under its state dir) unless one is given.
        directory = directory or local_platform.export_dir(os.environ.get("INFERBUS_EXPORT_DIR") or None).value
        redis_url = _redis(redis_url)

        async def run() -> list[Path]:
            store = await _store(redis_url)
            try:
                chosen = list(tenants) or await store.tenants()
                with click.progressbar(length=len(chosen), label=f"Exporting {month}", file=sys.stderr,
                                       show_pos=True) as bar:
                    return await export_month(store, month, directory, fmt=fmt or settings.export_format,
                                              width=bucket or settings.export_bucket,
                                              tenants=list(tenants) if tenants else None, force=force,
                                              on_tenant=lambda _: bar.update(1))
            finally:
                await store.redis.aclose()

        written = asyncio.run(run())
        if not written and not force:
            click.echo(f"Nothing written: {month} is already exported (--force writes it again) or had no usage.",
                       err=True)
        for path in written:
            click.echo(str(path))

    @usage.command("rebuild")
    @click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
    @click.option("--nats-url", envvar="NATS_URL", default=None,
                  help="NATS server with the USAGE stream (env NATS_URL; credentials from NATS_USER/NATS_PASSWORD). "
                       "Default: the local platform `inferbus up` runs (with its operator credentials), "
                       "else nats://127.0.0.1:4222.")
    @click.option("--batch", default=2000, show_default=True, type=click.IntRange(1, 10_000),
                  help="Usage events per pull request.")
    @_redis_option
    def usage_rebuild(yes: bool, nats_url: str | None, batch: int, redis_url: str | None) -> None:
        """Recount every usage rollup from the ledger (the USAGE stream), from its first event.

        Starts a new rollup generation (readers switch to it at once and see totals fill up),
        replays the ledger through the `usage-rollup` consumer (running billing services help),
        then deletes the old generation. Budgets' monthly spend is not touched. Safe while the
        platform runs; run one rebuild at a time.
        """
        if not yes:
            click.confirm("Recount all usage rollups from the ledger? Usage queries show partial totals "
                          "until it finishes.", abort=True)
        from tools.commands import local_platform

        nats = local_platform.nats_url(nats_url)
        click.echo(nats.note, err=True)
        redis_url = _redis(redis_url)
        started = time.monotonic()
        counted, total = asyncio.run(_rebuild(nats.value, redis_url, batch))
        click.echo(f"Rebuilt usage rollups from {total:,} ledger events in {time.monotonic() - started:.1f} s "
                   f"({counted:,} counted by this process; running billing replicas may have counted the rest).")

    @main.group()
    def prices() -> None:
        """The price book, through the gateway's admin API (--url, --admin-key).

        Prices are dollars per 1M tokens (uncached input, cached input, output) per model and
        adapter (`*` matches any), with a batch discount, and versioned: a version applies from its
        effective time on, so periods already billed keep their prices.
        """

    @prices.command("list")
    @click.option("--at", default=None, type=TIME, help="Mark the versions in force at this time (default now).")
    @click.option("--json", "as_json", is_flag=True, help="Print the versions as JSON.")
    @admin_options
    def prices_list(at: float | None, as_json: bool, url: str | None, admin_key: str) -> None:
        """List every price version; `*` marks those in force."""
        query = f"?at={at}" if at is not None else ""
        found = admin_api(url, admin_key).call("GET", f"/prices{query}")["data"]
        if as_json:
            click.echo(json.dumps(found, indent=2))
            return
        if not found:
            click.echo("The price book is empty (the billing service seeds it when it starts).")
            return
        rows = [["*" if p["in_force"] else "", p["model"], p["adapter"] if p["adapter"] != "" else "(base)",
                 _iso(p["effective"]) if p["effective"] > 0 else "always", f"{p['input']:g}", f"{p['cached_input']:g}",
                 f"{p['output']:g}", f"{p['batch_discount'] * 100:g}%"] for p in found]
        click.echo(table(["", "MODEL", "ADAPTER", "EFFECTIVE", "INPUT $/1M", "CACHED $/1M", "OUTPUT $/1M",
                          "BATCH OFF"], rows))

    @prices.command("set")
    @click.option("--model", default="*", show_default=True, help="Model id, or `*` for every model.")
    @click.option("--adapter", default="*", show_default=True,
                  help="Adapter name, `*` for any (the base model included) or `-` for the base model only.")
    @click.option("--input", "input_price", required=True, type=click.FloatRange(min=0),
                  help="Dollars per 1M uncached prompt tokens.")
    @click.option("--cached-input", required=True, type=click.FloatRange(min=0),
                  help="Dollars per 1M cached prompt tokens.")
    @click.option("--output", required=True, type=click.FloatRange(min=0), help="Dollars per 1M completion tokens.")
    @click.option("--batch-discount", default=0.5, show_default=True, type=click.FloatRange(0, 1),
                  help="Fraction off for requests of a batch.")
    @click.option("--effective", default=None, type=TIME,
                  help="When it takes effect (at least 60 s from now; default: the next minute after that).")
    @admin_options
    def prices_set(model: str, adapter: str, input_price: float, cached_input: float, output: float,
                   batch_discount: float, effective: float | None, url: str | None, admin_key: str) -> None:
        """Add a price version for a model and adapter, effective from a future time."""
        body = {"model": model, "adapter": "" if adapter in ("-", "base") else adapter, "input": input_price,
                "cached_input": cached_input, "output": output, "batch_discount": batch_discount,
                "effective": effective}
        version = admin_api(url, admin_key).call("POST", "/prices", body)
        click.echo(f"Price for model {version['model']!r} adapter {version['adapter'] or '(base)'!r} from "
                   f"{_iso(version['effective'])}: ${version['input']:g} input, ${version['cached_input']:g} cached, "
                   f"${version['output']:g} output per 1M tokens, {version['batch_discount'] * 100:g}% off batches.")


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


async def _store(redis_url: str) -> Any:
    from inferbus.runtime import redis_conn
    from services.billing.service import usage_store

    return usage_store(redis_conn.async_client(redis_url, socket_timeout=10), _billing_settings())


async def _rebuild(nats_url: str, redis_url: str, batch: int) -> tuple[int, int]:
    from inferbus.bus import connection as bus
    from inferbus.stores.billing import PriceStore
    from services.billing.rollup import rebuild
    from services.billing.service import default_prices
    from tools.commands import local_platform

    settings = _billing_settings()
    nc = await local_platform.connect_bus(nats_url, "usage-rebuild")
    store = await _store(redis_url)
    try:
        await bus.ensure_streams(nc.jetstream())
        prices = PriceStore(store.redis, default=default_prices(settings))
        with click.progressbar(length=1, label="Replaying the ledger", file=sys.stderr, show_pos=True) as bar:
            def progress(done: int, total: int) -> None:
                bar.length = max(total, done, 1)
                bar.update(done - bar.pos)

            return await rebuild(nc, nats_url, store, prices, batch=batch, ack_wait_s=settings.ack_wait_s,
                                 on_progress=progress)
    finally:
        await nc.drain()
        await store.redis.aclose()
