"""Usage rollups, queries and their answers: pure functions, no I/O, no clock (callers pass `now`).

A usage event contributes to one **group** (model, adapter, band, API key, batch id, release) of its tenant
in three time buckets: its minute, hour and UTC day, all taken from the time the gateway accepted
the request (`UsageEvent.started`; every publisher of a request's event reports the same one, so a
request's bucket, price and dedup set never depend on who reported it). Per group and bucket the
rollup keeps nine integer counters (`METRICS`). Every query regroups those counters: group by
any subset of the dimensions, bucket widths 1m / 1h / 1d, pages of buckets with an opaque cursor.

The answers have the shape of OpenAI's organisation usage and costs APIs (see docs/billing.md).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal, NamedTuple

import msgspec

from inferbus.stores.pricing import LineCosts, PriceBook
from proto import messages as m

WIDTHS: dict[str, int] = {"1m": 60, "1h": 3600, "1d": 86400}
# (default, maximum) buckets per page, as OpenAI's usage API has them.
PAGE_LIMITS: dict[str, tuple[int, int]] = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}
# `release` last: groups written before it existed have five parts and read as release "".
DIMENSIONS = ("model", "adapter", "band", "api_key_id", "batch_id", "release")
# Counters per group and bucket, in this order everywhere (the Lua script, exports, results).
# (requests, cancelled, failed, input tokens, cached, output, µ$ input, µ$ cached, µ$ output)
METRICS = ("n", "nc", "nf", "in", "cin", "out", "$in", "$cin", "$out")
STATUS_CODES = {"completed": 0, "cancelled": 1, "failed": 2}
# The account that the work of abandoned attempts rolls up under (`UsageEvent.billed_to ==
# "platform"`): the platform's cost, never a tenant's bill. Not a valid tenant id, so no tenant
# can ever be one; operators query it like a tenant (`/admin/v1/usage?tenant=_platform`).
PLATFORM_ACCOUNT = "_platform"
GROUP_SEP = "\x1f"  # between the dimensions of a group

Kind = Literal["usage", "costs"]

# group_by values a client may ask for, and the dimension each means.
_GROUP_BY = {"model": "model", "adapter": "adapter", "band": "band", "tier": "band", "api_key": "api_key_id",
             "api_key_id": "api_key_id", "batch": "batch", "batch_id": "batch_id", "release": "release"}
_ADMIN_GROUP_BY = {"tenant": "tenant", "project_id": "tenant"}
_COSTS_GROUP_BY = {"line_item": "line_item"}


# ---- events → rollup contributions ------------------------------------------------------------

def group_of(event: m.UsageEvent) -> str:
    return GROUP_SEP.join((event.model, event.adapter or "", event.band, event.api_key_id, event.batch_id or "",
                           event.release))


class Contribution(NamedTuple):
    """What one usage event adds to its tenant's rollups."""

    tenant: str
    model: str
    costs: LineCosts
    # What the ingest script gets: request_id, started (unix seconds: picks the minute, hour and
    # day buckets and the dedup set), group, status code, input, cached, output tokens, and the
    # micro-dollars of the three token kinds.
    row: tuple[str, int, str, int, int, int, int, int, int, int]

    @property
    def request_id(self) -> str:
        return self.row[0]

    @property
    def input_tokens(self) -> int:
        return self.row[4]

    @property
    def cached_tokens(self) -> int:
        return self.row[5]

    @property
    def output_tokens(self) -> int:
        return self.row[6]


def contribution(event: m.UsageEvent, book: PriceBook) -> Contribution:
    """The event's rollup contribution, priced by the book at the time the request was accepted.

    The one definition of what a request costs: the rollups, `/v1/costs`, exports and the budget
    reconciler all use it.
    """
    u = event.usage
    prompt, completion, cached = u.prompt_tokens, u.completion_tokens, u.cached_tokens
    if prompt < 0:
        prompt = 0
    if completion < 0:
        completion = 0
    if cached < 0 or cached > prompt:
        cached = 0 if cached < 0 else prompt
    costs = book.price_at(event.model, event.adapter, event.started).line_costs(
        prompt, completion, cached, event.batch_id is not None and event.batch_id != "")
    account = PLATFORM_ACCOUNT if event.billed_to == "platform" else event.tenant
    return Contribution(account, event.model, costs,
                        (m.usage_msg_id(event), int(event.started), group_of(event), STATUS_CODES.get(event.status, 0),
                         prompt, cached, completion, costs[0], costs[1], costs[2]))


# ---- counters -------------------------------------------------------------------------------------

@dataclass
class Totals:
    requests: int = 0
    cancelled: int = 0
    failed: int = 0
    input_tokens: int = 0  # prompt tokens, cached ones included (as OpenAI counts input_tokens)
    cached_tokens: int = 0
    output_tokens: int = 0
    input_cost: int = 0  # micro-dollars, uncached prompt tokens
    cached_cost: int = 0
    output_cost: int = 0

    _ORDER = ("requests", "cancelled", "failed", "input_tokens", "cached_tokens", "output_tokens", "input_cost",
              "cached_cost", "output_cost")

    @classmethod
    def packed(cls, raw: bytes) -> Totals:
        """From a rollup value: the nine counters of `METRICS` as a msgpack array."""
        values = [int(x) for x in _unpack(raw)]
        values += [0] * (9 - len(values))
        return cls(*values[:9])

    def add(self, other: Totals) -> None:
        for name in self._ORDER:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def cost(self) -> int:
        return self.input_cost + self.cached_cost + self.output_cost


_unpack = msgspec.msgpack.Decoder(list[float]).decode  # Lua writes whole numbers, maybe as doubles


def parse_rollup(fields: Mapping[bytes | str, bytes]) -> dict[str, Totals]:
    """A rollup hash (HGETALL) as {group: Totals}."""
    return {(k.decode() if isinstance(k, bytes) else k): Totals.packed(v) for k, v in fields.items()}


def split_group(group: str) -> dict[str, str]:
    parts = group.split(GROUP_SEP)
    parts += [""] * (len(DIMENSIONS) - len(parts))
    return dict(zip(DIMENSIONS, parts))


# ---- queries ----------------------------------------------------------------------------------------

class QueryError(ValueError):
    """A bad query parameter; `param` names it (answered with 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class UsageQuery:
    start: int  # first bucket's start (start_time rounded down to the bucket width)
    end: int  # exclusive: end_time rounded up to the bucket width
    width: str  # "1m" | "1h" | "1d"
    group_by: tuple[str, ...] = ()
    limit: int = 7
    page: int | None = None  # start of the first bucket of this page (from the cursor)
    models: tuple[str, ...] = ()
    api_key_ids: tuple[str, ...] = ()
    tenants: tuple[str, ...] = ()  # admin only; empty = every tenant

    @property
    def seconds(self) -> int:
        return WIDTHS[self.width]


def resolve_group_by(names: Iterable[str], *, kind: Kind = "usage", admin: bool = False) -> tuple[str, ...]:
    """Canonical dimensions for `group_by` names (aliases resolved, duplicates dropped); QueryError."""
    allowed = dict(_GROUP_BY)
    if admin:
        allowed.update(_ADMIN_GROUP_BY)
    if kind == "costs":
        allowed.update(_COSTS_GROUP_BY)
    group_by: list[str] = []
    for name in names:
        if name not in allowed:
            raise QueryError(f"Cannot group by `{name}`; choose from {', '.join(sorted(allowed))}.", "group_by")
        if allowed[name] not in group_by:
            group_by.append(allowed[name])
    return tuple(group_by)


def floor_to(ts: float, width: int) -> int:
    return int(ts // width) * width


def ceil_to(ts: float, width: int) -> int:
    return -int(-ts // width) * width


def _values(items: Sequence[tuple[str, str]], name: str) -> list[str]:
    """Every value of a repeatable parameter: `a=x&a=y`, `a[]=x`, or `a=x,y`."""
    out: list[str] = []
    for key, value in items:
        if key == name or key == name + "[]":
            out += [part.strip() for part in value.split(",") if part.strip()]
    return out


def _one(items: Sequence[tuple[str, str]], name: str) -> str | None:
    found = [value for key, value in items if key == name]
    if len(found) > 1:
        raise QueryError(f"`{name}` may be given once.", name)
    return found[0] if found else None


def _int(raw: str | None, name: str) -> int | None:
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise QueryError(f"`{name}` must be an integer (unix seconds for times), not {raw!r}.", name) from None


def parse_query(items: Sequence[tuple[str, str]], *, now: float, kind: Kind = "usage", admin: bool = False,
                minute_retention_s: int = 48 * 3600) -> UsageQuery:
    """Validate the query string of /v1/usage or /v1/costs (or their admin versions); QueryError."""
    known = {"start_time", "end_time", "bucket_width", "group_by", "limit", "page", "models", "api_key_ids"}
    if admin:
        known |= {"tenant", "tenants", "project_ids"}
    for key, _ in items:
        if key.removesuffix("[]") not in known:
            raise QueryError(f"Unknown parameter `{key}`.", key)
    width = _one(items, "bucket_width") or "1d"
    if width not in WIDTHS:
        raise QueryError(f"`bucket_width` must be one of 1m, 1h, 1d, not {width!r}.", "bucket_width")
    seconds = WIDTHS[width]
    start_time = _int(_one(items, "start_time"), "start_time")
    if start_time is None:
        raise QueryError("`start_time` is required (unix seconds, inclusive).", "start_time")
    if start_time < 0:
        raise QueryError("`start_time` must not be negative.", "start_time")
    end_time = _int(_one(items, "end_time"), "end_time")
    if end_time is None:
        end_time = max(int(now) + 1, start_time + 1)
    if end_time <= start_time:
        raise QueryError("`end_time` must be after `start_time`.", "end_time")
    if width == "1m" and start_time < now - minute_retention_s:
        hours = minute_retention_s / 3600
        raise QueryError(f"1m buckets are kept for {hours:g} hours; use bucket_width=1h for older usage.",
                         "start_time")
    group_by = resolve_group_by(_values(items, "group_by"), kind=kind, admin=admin)
    default_limit, max_limit = PAGE_LIMITS[width]
    limit = _int(_one(items, "limit"), "limit")
    if limit is None:
        limit = default_limit
    if not 1 <= limit <= max_limit:
        raise QueryError(f"`limit` must be between 1 and {max_limit} for bucket_width={width}.", "limit")
    start, end = floor_to(start_time, seconds), ceil_to(end_time, seconds)
    page = None
    raw_page = _one(items, "page")
    if raw_page:
        page = decode_cursor(raw_page)
        if page < start or page >= end or page % seconds:
            raise QueryError("`page` does not belong to this query (use the `next_page` it returned).", "page")
    tenants = (
        tuple(_values(items, "tenant") + _values(items, "tenants") + _values(items, "project_ids")) if admin else ()
    )
    return UsageQuery(start=start, end=end, width=width, group_by=group_by, limit=limit, page=page,
                      models=tuple(_values(items, "models")), api_key_ids=tuple(_values(items, "api_key_ids")),
                      tenants=tenants)


# ---- pages --------------------------------------------------------------------------------------

_CURSOR_PREFIX = "page_"


def encode_cursor(bucket_start: int) -> str:
    raw = f"v1:{bucket_start}".encode()
    return _CURSOR_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    if not cursor.startswith(_CURSOR_PREFIX):
        raise QueryError("`page` is not a cursor this API returned.", "page")
    body = cursor[len(_CURSOR_PREFIX):]
    try:
        text = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode()
        version, _, value = text.partition(":")
        if version != "v1":
            raise ValueError(version)
        return int(value)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise QueryError("`page` is not a cursor this API returned.", "page") from None


def page_buckets(query: UsageQuery) -> tuple[list[int], str | None]:
    """Starts of this page's buckets, and the cursor of the next page (None on the last)."""
    width = query.seconds
    first = query.page if query.page is not None else query.start
    starts = [s for s in range(first, min(query.end, first + query.limit * width), width)]
    following = first + query.limit * width
    return starts, encode_cursor(following) if following < query.end else None


# ---- answers ------------------------------------------------------------------------------------

GroupValues = tuple[Any, ...]


def _group_values(dims: Mapping[str, str], tenant: str, group_by: Sequence[str]) -> GroupValues:
    values: list[Any] = []
    for name in group_by:
        if name == "tenant":
            values.append(tenant)
        elif name == "batch":
            values.append(bool(dims["batch_id"]))
        elif name == "line_item":
            values.append(None)  # split later, per token kind
        else:
            values.append(dims[name] or None)
    return tuple(values)


def regroup(rollups: Mapping[str, Mapping[str, Totals]], query: UsageQuery) -> dict[GroupValues, Totals]:
    """One bucket's rollups of one or more tenants ({tenant: {group: Totals}}), regrouped by the
    query's `group_by` and filtered by its `models` and `api_key_ids`."""
    out: dict[GroupValues, Totals] = {}
    for tenant, groups in rollups.items():
        for group, totals in groups.items():
            dims = split_group(group)
            if query.models and dims["model"] not in query.models:
                continue
            if query.api_key_ids and dims["api_key_id"] not in query.api_key_ids:
                continue
            key = _group_values(dims, tenant, query.group_by)
            into = out.get(key)
            if into is None:
                into = out[key] = Totals()
            into.add(totals)
    return out


def _sort_key(values: GroupValues) -> tuple[str, ...]:
    return tuple("" if v is None else str(v) for v in values)


_EXTENSIONS = ("adapter", "band", "batch_id", "release")


def _group_fields(group_by: Sequence[str], values: GroupValues) -> dict[str, Any]:
    grouped = dict(zip(group_by, values))
    fields: dict[str, Any] = {"project_id": grouped.get("tenant"), "user_id": None,
                              "api_key_id": grouped.get("api_key_id"), "model": grouped.get("model"),
                              "batch": grouped.get("batch")}
    if "tenant" in grouped:
        fields["tenant"] = grouped["tenant"]
    for name in _EXTENSIONS:  # ours, not OpenAI's: present only when grouped by
        if name in grouped:
            fields[name] = grouped[name]
    return fields


def usage_results(groups: Mapping[GroupValues, Totals], group_by: Sequence[str]) -> list[dict[str, Any]]:
    results = []
    for values in sorted(groups, key=_sort_key):
        t = groups[values]
        results.append({
            "object": "organization.usage.completions.result",
            "input_tokens": t.input_tokens, "output_tokens": t.output_tokens,
            "input_cached_tokens": t.cached_tokens, "input_audio_tokens": 0, "output_audio_tokens": 0,
            "num_model_requests": t.requests,
            **_group_fields(group_by, values),
        })
    return results


def dollars(micro: int) -> float:
    return micro / 1_000_000


def usd_text(micro: int) -> str:
    """Exact dollars with 6 decimals, as text: 105 -> '0.000105'."""
    return str(Decimal(micro).scaleb(-6).quantize(Decimal("0.000001")))


_LINE_ITEMS = (("input", "input_cost"), ("cached input", "cached_cost"), ("output", "output_cost"))


def cost_results(groups: Mapping[GroupValues, Totals], group_by: Sequence[str]) -> list[dict[str, Any]]:
    by_line = "line_item" in group_by
    results = []
    for values in sorted(groups, key=_sort_key):
        t = groups[values]
        fields = _group_fields(group_by, values)
        model = fields.get("model")
        if by_line:
            # A line item per token kind: "<model>, input", "<model>, cached input", "<model>, output".
            for label, attribute in _LINE_ITEMS:
                micro = getattr(t, attribute)
                if micro == 0:
                    continue
                item = f"{model}, {label}" if model else label
                results.append({"object": "organization.costs.result",
                                "amount": {"value": dollars(micro), "currency": "usd"},
                                "line_item": item, **fields})
        else:
            results.append({"object": "organization.costs.result",
                            "amount": {"value": dollars(t.cost), "currency": "usd"}, "line_item": None, **fields})
    return results


def page_body(buckets: Iterable[tuple[int, list[dict[str, Any]]]], width: str, next_page: str | None) -> dict[str, Any]:
    seconds = WIDTHS[width]
    data = [{"object": "bucket", "start_time": start, "end_time": start + seconds, "results": results}
            for start, results in buckets]
    return {"object": "page", "data": data, "has_more": next_page is not None, "next_page": next_page}


# ---- exports --------------------------------------------------------------------------------------

EXPORT_COLUMNS = (
    "tenant",
    "start_time",
    "end_time",
    "bucket_start",
    "model",
    "adapter",
    "band",
    "api_key_id",
    "batch_id",
    "release",
    "num_model_requests",
    "num_cancelled_requests",
    "num_failed_requests",
    "input_tokens",
    "input_cached_tokens",
    "output_tokens",
    "input_cost_micro_usd",
    "cached_input_cost_micro_usd",
    "output_cost_micro_usd",
    "cost_micro_usd",
    "cost_usd",
)
EXPORT_GROUP_BY = ("model", "adapter", "band", "api_key_id", "batch_id", "release")


def export_rows(bucket_start: int, width: str, groups: Mapping[GroupValues, Totals], group_by: Sequence[str],
                tenant: str | None = None) -> list[dict[str, Any]]:
    """One row per group of one bucket, every column present (None where not grouped by)."""
    import datetime as dt

    iso = dt.datetime.fromtimestamp(bucket_start, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    rows = []
    for values in sorted(groups, key=_sort_key):
        t = groups[values]
        grouped = dict(zip(group_by, values))
        batch_id = grouped.get("batch_id")
        if batch_id is None and grouped.get("batch") is not None:
            batch_id = "(batch)" if grouped["batch"] else ""
        rows.append({
            "tenant": grouped.get("tenant", tenant), "start_time": bucket_start,
            "end_time": bucket_start + WIDTHS[width], "bucket_start": iso,
            "model": grouped.get("model"), "adapter": grouped.get("adapter"), "band": grouped.get("band"),
            "api_key_id": grouped.get("api_key_id"), "batch_id": batch_id, "release": grouped.get("release"),
            "num_model_requests": t.requests, "num_cancelled_requests": t.cancelled, "num_failed_requests": t.failed,
            "input_tokens": t.input_tokens, "input_cached_tokens": t.cached_tokens, "output_tokens": t.output_tokens,
            "input_cost_micro_usd": t.input_cost, "cached_input_cost_micro_usd": t.cached_cost,
            "output_cost_micro_usd": t.output_cost, "cost_micro_usd": t.cost, "cost_usd": usd_text(t.cost),
        })
    return rows
