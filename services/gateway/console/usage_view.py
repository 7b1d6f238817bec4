"""A tenant's usage page from export rows: pure, no I/O, no clock (callers pass `now`).

The page's every number is a sum of the rows `inferbus usage export` writes for the same window
(`inferbus.stores.usage_export.collect_rows`, daily buckets, every dimension): totals, one table
per day and per model, adapter, band, release and API key, and the series of its charts. Nothing
is read from anywhere else, so the page and the export cannot disagree.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inferbus.stores import usage as u

DAY = 86400
MAX_WINDOW_DAYS = 400  # as long as the ledger and the rollups are kept
# The dimensions the page has a table for: (row column, heading, what an empty value means).
DIMENSIONS: tuple[tuple[str, str, str], ...] = (
    ("model", "model", ""),
    ("adapter", "adapter", "(base model)"),
    ("band", "band", ""),
    ("release", "release", "(unpinned workers)"),
    ("api_key_id", "API key", "(none)"),
)


class WindowError(ValueError):
    """A bad `from`/`to` of the page (answered with 400, naming `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Window:
    """Whole UTC days: `start` inclusive, `end` exclusive (unix seconds, both at midnight)."""

    start: int
    end: int

    @property
    def first_day(self) -> str:
        return _date(self.start)

    @property
    def last_day(self) -> str:
        return _date(self.end - DAY)

    @property
    def end_day(self) -> str:
        """The day after the last: what `inferbus usage export --to` takes (exclusive)."""
        return _date(self.end)

    def export_command(self, tenant: str, bucket: str = "1d") -> str:
        """The CLI command whose rows this window's page and CSV are made of."""
        command = f"inferbus usage export --tenant {tenant} --from {self.first_day} --to {self.end_day}"
        return command + (f" --bucket {bucket}" if bucket != "1h" else "")


def _date(ts: int) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d")


def _parse_day(text: str, param: str) -> int:
    try:
        day = dt.date.fromisoformat(text.strip())
    except ValueError:
        raise WindowError(f"`{param}` must be a date as YYYY-MM-DD, not {text!r}.", param) from None
    return int(dt.datetime(day.year, day.month, day.day, tzinfo=dt.timezone.utc).timestamp())


def window(start: str | None, last: str | None, now: float) -> Window:
    """The window of the page: from day `start` through day `last` (both YYYY-MM-DD, UTC, inclusive).
    Defaults: the first day of the current UTC month through today."""
    today = u.floor_to(now, DAY)
    if start:
        first = _parse_day(start, "from")
    else:
        current = dt.datetime.fromtimestamp(now, dt.timezone.utc)
        first = int(dt.datetime(current.year, current.month, 1, tzinfo=dt.timezone.utc).timestamp())
    final = _parse_day(last, "to") if last else today
    if final < first:
        raise WindowError("`to` must not be before `from`.", "to")
    if (final - first) // DAY + 1 > MAX_WINDOW_DAYS:
        raise WindowError(f"A window is at most {MAX_WINDOW_DAYS} days.", "from")
    return Window(first, final + DAY)


@dataclass
class Sums:
    """Sums of export rows' counters."""

    requests: int = 0
    cancelled: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    cost_micro: int = 0

    def add(self, row: Mapping[str, Any]) -> None:
        self.requests += row["num_model_requests"]
        self.cancelled += row["num_cancelled_requests"]
        self.failed += row["num_failed_requests"]
        self.input_tokens += row["input_tokens"]
        self.cached_tokens += row["input_cached_tokens"]
        self.output_tokens += row["output_tokens"]
        self.cost_micro += row["cost_micro_usd"]

    @property
    def cost_usd(self) -> str:
        """Exact dollars, as the export's `cost_usd` column writes them."""
        return u.usd_text(self.cost_micro)


@dataclass
class Line:
    key: str  # the dimension's value as the export has it ("" for none)
    label: str
    sums: Sums


@dataclass
class UsagePage:
    window: Window
    total: Sums
    days: list[Line]
    tables: dict[str, list[Line]]  # dimension column → its lines, most expensive first
    charts: dict[str, Any] = field(default_factory=dict)


def summarize(rows: Iterable[Mapping[str, Any]], win: Window, key_names: Mapping[str, str] | None = None) -> UsagePage:
    """The page of export rows (one tenant's, any bucket width) over `win`."""
    names = dict(key_names or {})
    total = Sums()
    by_day: dict[int, Sums] = {}
    by: dict[str, dict[str, Sums]] = {column: {} for column, _, _ in DIMENSIONS}
    cost_by_day_model: dict[tuple[int, str], int] = {}
    for row in rows:
        total.add(row)
        day = u.floor_to(row["start_time"], DAY)
        by_day.setdefault(day, Sums()).add(row)
        for column, _, _ in DIMENSIONS:
            value = row.get(column) or ""
            by[column].setdefault(value, Sums()).add(row)
        model = row.get("model") or ""
        cost_by_day_model[(day, model)] = cost_by_day_model.get((day, model), 0) + row["cost_micro_usd"]

    def label(column: str, value: str, empty: str) -> str:
        if not value:
            return empty
        if column == "api_key_id" and value in names:
            return f"{names[value]} ({value})" if names[value] else value
        return value

    tables = {
        column: [Line(value, label(column, value, empty), sums)
                 for value, sums in sorted(by[column].items(), key=lambda item: (-item[1].cost_micro, item[0]))]
        for column, _, empty in DIMENSIONS
    }
    days = [Line(_date(day), _date(day), by_day[day]) for day in sorted(by_day)]
    return UsagePage(win, total, days, tables, charts(win, by_day, cost_by_day_model))


def charts(win: Window, by_day: Mapping[int, Sums], cost_by_day_model: Mapping[tuple[int, str], int]) -> dict[str, Any]:
    """Chart.js data: cost per day stacked by model, and tokens per day by kind, every day of the window."""
    days = list(range(win.start, win.end, DAY))
    labels = [_date(day) for day in days]
    models = sorted({model for _, model in cost_by_day_model})
    cost = {
        "labels": labels,
        "datasets": [{"label": model or "(none)",
                      "data": [u.dollars(cost_by_day_model.get((day, model), 0)) for day in days]} for model in models],
    }
    empty = Sums()
    tokens = {
        "labels": labels,
        "datasets": [
            {"label": "input (uncached)",
             "data": [by_day.get(d, empty).input_tokens - by_day.get(d, empty).cached_tokens for d in days]},
            {"label": "input (cached)", "data": [by_day.get(d, empty).cached_tokens for d in days]},
            {"label": "output", "data": [by_day.get(d, empty).output_tokens for d in days]},
        ],
    }
    return {"cost": cost, "tokens": tokens}


def rows_of_tenant(rows: Sequence[Mapping[str, Any]], tenant: str) -> list[Mapping[str, Any]]:
    """Only `tenant`'s rows: a guard on top of reading that tenant's rollups alone."""
    return [row for row in rows if row.get("tenant") == tenant]
