"""Usage exports: one row per bucket per group with tokens and dollars, as CSV, JSONL or Parquet.

The rows and their writer (`collect_rows`, `write_rows`) are the library's
(`inferbus.stores.usage_export`), shared with `inferbus usage export` and the web console;
`export_month` writes each tenant's file of one calendar month into a directory, atomically
(temporary file, then rename) and marks the month done in Redis; `MonthlyExporter` does that in
the billing service for last month, once, after the month has ended and the ledger is caught up.
"""

from __future__ import annotations

import asyncio
import calendar
import datetime as dt
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from inferbus.runtime import logs
from inferbus.stores.billing import UsageStore, export_lock_key, exported_key
from inferbus.stores.usage_export import FORMATS, collect_rows, write_rows

__all__ = ["FORMATS", "MonthlyExporter", "collect_rows", "export_month", "month_of", "month_range", "previous_month",
           "write_rows"]

from . import metrics

log = logs.get(__name__)
_MONTH = re.compile(r"^(\d{4})-(0[1-9]|1[0-2])$")


def month_range(month: str) -> tuple[int, int]:
    """Unix start and end (exclusive) of a UTC calendar month given as YYYY-MM."""
    match = _MONTH.match(month)
    if not match:
        raise ValueError(f"a month is YYYY-MM, not {month!r}")
    year, number = int(match.group(1)), int(match.group(2))
    start = calendar.timegm((year, number, 1, 0, 0, 0))
    end = calendar.timegm((year + number // 12, number % 12 + 1, 1, 0, 0, 0))
    return start, end


def month_of(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m")


def previous_month(ts: float) -> str:
    start, _ = month_range(month_of(ts))
    return month_of(start - 1)


def _atomic_write(path: Path, rows: Sequence[dict[str, Any]], fmt: str) -> None:
    """Write the file whole or not at all; a tenant's bill is private: 0600 in a 0700 month directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_rows(rows, fmt, temporary)
    os.chmod(temporary, 0o600)
    os.replace(temporary, path)


async def export_month(store: UsageStore, month: str, directory: Path, *, fmt: str = "csv", width: str = "1h",
                       tenants: Sequence[str] | None = None, force: bool = False,
                       on_tenant: Callable[[str], None] | None = None) -> list[Path]:
    """Write `<directory>/<month>/<tenant>.<fmt>` for every tenant with usage that month; mark it done.

    Idempotent: files are replaced atomically, and a month marked done is skipped unless `force`.
    Returns the files written (none if the month was already done).
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if width not in ("1h", "1d"):
        raise ValueError("monthly exports use 1h or 1d buckets")
    if not force and await store.redis.exists(exported_key(month)):
        return []
    start, end = month_range(month)
    written: list[Path] = []
    for tenant in tenants if tenants is not None else await store.tenants():
        rows = await collect_rows(store, [tenant], start, end, width)
        if on_tenant is not None:
            on_tenant(tenant)
        if not rows:
            continue
        path = directory / month / f"{tenant}.{fmt}"
        try:
            await asyncio.to_thread(_atomic_write, path, rows, fmt)
        except Exception:
            metrics.EXPORTS.labels("failed").inc()
            raise
        metrics.EXPORTS.labels("written").inc()
        written.append(path)
    if tenants is None:
        await store.redis.set(exported_key(month), str(len(written)))
    return written


class MonthlyExporter:
    """Writes last month's exports once: after `delay_s` into the new month, when the rollup has
    caught up with the ledger, by whichever billing replica takes the month's lock first."""

    def __init__(self, store: UsageStore, directory: Path, *, fmt: str, width: str, delay_s: int,
                 caught_up: Callable[[], Awaitable[bool]], clock: Callable[[], float],
                 interval_s: float = 60.0) -> None:
        self.store = store
        self.directory = directory
        self.fmt = fmt
        self.width = width
        self.delay_s = delay_s
        self.caught_up = caught_up
        self.clock = clock
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def due(self, now: float) -> str | None:
        """The month to export now, if any (pure: the marker is checked by `check`)."""
        current_start, _ = month_range(month_of(now))
        return previous_month(now) if now >= current_start + self.delay_s else None

    async def check(self) -> list[Path]:
        month = self.due(self.clock())
        if month is None or await self.store.redis.exists(exported_key(month)):
            return []
        if await self.store.state.rebuilding():
            log.info("monthly_export_waiting", month=month, reason="a rebuild is running")
            return []
        if not await self.caught_up():
            log.info("monthly_export_waiting", month=month, reason="rollup behind the ledger")
            return []
        if not await self.store.redis.set(export_lock_key(month), "1", nx=True, ex=600):
            return []  # another replica is writing it
        try:
            written = await export_month(self.store, month, self.directory, fmt=self.fmt, width=self.width)
        finally:
            await self.store.redis.delete(export_lock_key(month))
        log.info("monthly_export_written", month=month, files=len(written), directory=str(self.directory))
        return written

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="monthly-export")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("monthly_export_failed")
            await asyncio.sleep(self.interval_s)
