"""Billing's pure parts: prices and the versioned price book, bucket math, queries and their
answers, cursors, export writers, the monthly schedule and the ledger puller's frame parser."""

from __future__ import annotations

import asyncio
import calendar
import csv
import io
import json
from pathlib import Path

import msgspec
import pytest

from inferbus.stores import usage as u
from inferbus.stores.pricing import (
    InvalidPrice,
    LineCosts,
    NoPrice,
    PriceBook,
    Prices,
    PriceVersion,
    effective_versions,
    to_micro,
)
from inferbus.stores.tenants import valid_tenant_id
from proto import messages as m
from services.billing.export import month_range, previous_month, write_rows
from services.billing.pull import PullConnection, num_pending

MODEL = "meta-llama/Llama-3.3-70B-Instruct"
DEFAULT = Prices(0.60, 0.90, 0.15, 0.5)


# ---- prices -------------------------------------------------------------------------------------

def test_prices_keep_the_admission_estimate_api() -> None:
    prices = Prices(0.60, 0.90, 0.15)  # positional: input, output, cached input
    assert prices.cost(1000, 500, 200) == pytest.approx((800 * 0.60 + 200 * 0.15 + 500 * 0.90) / 1e6)
    assert prices.batch_discount == 0.0


def test_line_costs_are_exact_micro_dollars_rounded_half_to_even() -> None:
    prices = Prices(1.0, 3.0, 0.5)  # 1, 3 and 0.5 µ$ per token
    assert prices.line_costs(10, 7, 4) == LineCosts(6, 2, 21)
    assert prices.cost_micro(10, 7, 4) == 29
    half = Prices(0.5, 1.5, 0.5)  # 0.5 µ$ per token: ties round to even
    assert half.line_costs(1, 1, 0) == LineCosts(0, 0, 2)  # 0.5 -> 0, 1.5 -> 2
    assert half.line_costs(3, 3, 0) == LineCosts(2, 0, 4)  # 1.5 -> 2, 4.5 -> 4
    assert Prices(0.6, 0.9, 0.15).line_costs(7, 1, 0) == LineCosts(4, 0, 1)  # 4.2 -> 4, 0.9 -> 1


def test_batch_requests_get_the_discount_and_cached_tokens_never_exceed_the_prompt() -> None:
    assert DEFAULT.line_costs(1_000_000, 1_000_000, 0, batch=True) == LineCosts(300_000, 0, 450_000)
    assert DEFAULT.line_costs(1_000_000, 1_000_000, 0) == LineCosts(600_000, 0, 900_000)
    assert DEFAULT.line_costs(10, 0, 50) == DEFAULT.line_costs(10, 0, 10)  # at most the whole prompt is cached
    assert DEFAULT.line_costs(-5, -5, -5) == LineCosts(0, 0, 0)


@pytest.mark.slow
def test_line_costs_match_exact_rational_arithmetic() -> None:
    import random
    from fractions import Fraction

    rng = random.Random(6)
    for prices in (DEFAULT, Prices(1.234567, 0.000001, 2.5, 0.333333), Prices(0.5, 1.5, 0.5, 1.0)):
        for _ in range(5000):
            prompt, cached, output = rng.randint(0, 50_000), rng.randint(0, 60_000), rng.randint(0, 50_000)
            batch = rng.random() < 0.5
            keep = 1 - Fraction(str(prices.batch_discount)) if batch else Fraction(1)
            cached_in = min(cached, prompt)
            exact = [tokens * Fraction(str(price)) / 1_000_000 * 1_000_000 * keep for tokens, price in (
                (prompt - cached_in, prices.input_per_mtok), (cached_in, prices.cached_input_per_mtok),
                (output, prices.output_per_mtok))]
            assert prices.line_costs(prompt, output, cached, batch) == tuple(round(x) for x in exact)  # half to even


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), 0.0000001, "x"])
def test_prices_refuse_what_cannot_be_billed_exactly(bad: object) -> None:
    with pytest.raises(InvalidPrice):
        to_micro(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidPrice):
        Prices(0.6, 0.9, 0.15, batch_discount=1.5)


def test_to_micro_is_exact_for_decimal_prices() -> None:
    assert to_micro(0.6) == 600_000 and to_micro(0.15) == 150_000 and to_micro("2.000001") == 2_000_001


# ---- the price book -----------------------------------------------------------------------------

def version(model: str, adapter: str, effective: float, price: float, discount: float = 0.5) -> PriceVersion:
    return PriceVersion(model, adapter, effective, Prices(price, price, price, discount))


def test_a_price_change_applies_from_its_effective_time_and_old_periods_keep_their_prices() -> None:
    book = PriceBook([version("*", "*", 0, 1.0), version("*", "*", 1000, 2.0), version("*", "*", 2000, 3.0)])
    assert book.price_at(MODEL, None, 999.9).input_per_mtok == 1.0
    assert book.price_at(MODEL, None, 1000).input_per_mtok == 2.0
    assert book.price_at(MODEL, None, 1999).input_per_mtok == 2.0
    assert book.price_at(MODEL, None, 10**10).input_per_mtok == 3.0
    # Adding a later version changes nothing before it.
    later = book.with_version(version("*", "*", 5000, 9.0))
    for ts in (0, 999, 1000, 2500, 4999):
        assert later.price_at(MODEL, None, ts) == book.price_at(MODEL, None, ts)


def test_the_most_specific_entry_in_force_wins() -> None:
    book = PriceBook([
        version("*", "*", 0, 1.0),
        version(MODEL, "*", 100, 2.0),
        version(MODEL, "", 200, 3.0),  # the base model without adapter
        version("*", "lora-a", 0, 4.0),
        version(MODEL, "lora-a", 300, 5.0),
    ])
    assert book.price_at("other", None, 50).input_per_mtok == 1.0
    assert book.price_at(MODEL, None, 150).input_per_mtok == 2.0
    assert book.price_at(MODEL, None, 250).input_per_mtok == 3.0
    assert book.price_at(MODEL, "lora-b", 250).input_per_mtok == 2.0  # model/* beats */*
    assert book.price_at(MODEL, "lora-a", 250).input_per_mtok == 2.0  # model/* beats */lora-a
    assert book.price_at(MODEL, "lora-a", 350).input_per_mtok == 5.0
    assert book.price_at("other", "lora-a", 0).input_per_mtok == 4.0


def test_the_default_applies_where_no_entry_does_and_without_one_there_is_no_price() -> None:
    book = PriceBook([version(MODEL, "*", 1000, 2.0)], default=DEFAULT)
    assert book.price_at(MODEL, None, 999) == DEFAULT
    assert book.price_at("other", None, 5000) == DEFAULT
    with pytest.raises(NoPrice):
        PriceBook([version(MODEL, "*", 1000, 2.0)]).price_at(MODEL, None, 0)


def test_a_version_given_twice_keeps_the_last_and_listing_shows_those_in_force() -> None:
    book = PriceBook([version("*", "*", 0, 1.0), version("*", "*", 0, 1.5), version("*", "*", 100, 2.0)])
    assert len(book.versions) == 2 and book.price_at(MODEL, None, 50).input_per_mtok == 1.5
    assert [v.effective for v in effective_versions(book, 50)] == [0]
    assert [v.effective for v in effective_versions(book, 150)] == [100]


def test_price_versions_round_trip_and_refuse_bad_fields() -> None:
    v = version(MODEL, "lora-a", 1234.5, 0.25, 0.4)
    assert PriceVersion.from_dict(json.loads(json.dumps(v.to_dict()))) == v
    with pytest.raises(InvalidPrice) as raised:
        PriceVersion.from_dict({"model": "*", "input": 1, "output": 1, "cached_input": 1, "colour": "red"})
    assert raised.value.param == "colour"
    with pytest.raises(InvalidPrice):
        PriceVersion.from_dict({"model": "*", "input": 1, "output": 1})  # cached_input missing
    with pytest.raises(InvalidPrice):
        PriceVersion.from_dict({"model": "", "input": 1, "output": 1, "cached_input": 1})


# ---- contributions and rollups -----------------------------------------------------------------

def event(**fields: object) -> m.UsageEvent:
    base: dict[str, object] = dict(request_id="r1", tenant="acme", model=MODEL, status="completed",
                                   usage=m.Usage(prompt_tokens=100, completion_tokens=50, cached_tokens=40),
                                   started=1_790_000_123.7, finished=1_790_000_130.0, api_key_id="key_1")
    base.update(fields)
    return m.UsageEvent(**base)  # type: ignore[arg-type]


def test_an_event_is_priced_at_its_accept_time_with_the_batch_discount() -> None:
    book = PriceBook([version("*", "*", 0, 1.0, 0.5), version("*", "*", 1_790_000_200, 2.0, 0.5)])
    early = u.contribution(event(), book)
    assert early.costs == LineCosts(60, 40, 50)
    assert early.row[1] == 1_790_000_123 and early.row[3] == 0
    late = u.contribution(event(started=1_790_000_200.0), book)
    assert late.costs == LineCosts(120, 80, 100)
    batch = u.contribution(event(batch_id="batch_1", status="cancelled"), book)
    assert batch.costs == LineCosts(30, 20, 25) and batch.row[3] == 1
    assert u.split_group(batch.row[2]) == {"model": MODEL, "adapter": "", "band": "standard",
                                           "api_key_id": "key_1", "batch_id": "batch_1", "release": ""}
    released = u.contribution(event(release="sha256:" + "ab" * 32), book)
    assert u.split_group(released.row[2])["release"] == "sha256:" + "ab" * 32


def test_usage_groups_by_release_and_older_groups_read_as_no_release() -> None:
    stable, candidate = "sha256:" + "aa" * 32, "sha256:" + "cc" * 32
    rollups = {"acme": {
        group(): u.Totals(1, 0, 0, 10, 0, 5, 1, 0, 1),  # written before `release` was a dimension: five parts
        group() + u.GROUP_SEP + stable: u.Totals(3, 0, 0, 30, 0, 15, 3, 0, 3),
        group(key="key_2") + u.GROUP_SEP + stable: u.Totals(1, 0, 0, 10, 0, 5, 1, 0, 1),
        group() + u.GROUP_SEP + candidate: u.Totals(2, 0, 1, 20, 0, 10, 2, 0, 2),
    }}
    query = q(start_time=0, end_time=86400, bucket_width="1d", group_by="release")
    by_release = u.regroup(rollups, query)
    assert {k: t.requests for k, t in by_release.items()} == {(None,): 1, (stable,): 4, (candidate,): 2}
    results = u.usage_results(by_release, query.group_by)
    assert [(r["release"], r["num_model_requests"]) for r in results] == [(None, 1), (stable, 4), (candidate, 2)]
    costs = u.cost_results(by_release, query.group_by)
    assert {c["release"]: c["amount"]["value"] for c in costs}[candidate] == 4 / 1_000_000
    # Not grouped by release: the field is absent, and the totals are the same.
    assert "release" not in u.usage_results(u.regroup(rollups, q(start_time=0, end_time=86400)), ())[0]
    exported = u.export_rows(0, "1d", u.regroup(rollups, u.UsageQuery(0, 86400, "1d", group_by=u.EXPORT_GROUP_BY)),
                             u.EXPORT_GROUP_BY, "acme")
    assert sorted((r["release"] or "", r["api_key_id"], r["num_model_requests"]) for r in exported) == [
        ("", "key_1", 1), (stable, "key_1", 3), (stable, "key_2", 1), (candidate, "key_1", 2)]


def test_abandoned_attempts_are_the_platforms_cost_under_their_own_dedup_id() -> None:
    book = PriceBook([version("*", "*", 0, 1.0, 0.5)])
    tenant = u.contribution(event(attempts=2, attempt=1), book)
    assert tenant.tenant == "acme" and tenant.request_id == "r1"
    # The first attempt of the same request, given up after a false death verdict: its work is
    # counted (and priced) under the platform's account, and does not displace the tenant's event.
    abandoned = u.contribution(event(billed_to="platform", attempt=0, status="cancelled"), book)
    assert abandoned.tenant == u.PLATFORM_ACCOUNT and abandoned.request_id == "r1.0.abandoned"
    assert abandoned.costs == tenant.costs
    assert not valid_tenant_id(u.PLATFORM_ACCOUNT)  # no tenant can ever be billed as the platform
    # Events written before the field existed are the tenant's.
    old = msgspec.msgpack.decode(msgspec.msgpack.encode({k: v for k, v in msgspec.structs.asdict(event()).items()
                                                         if k not in ("billed_to", "attempt")}), type=m.UsageEvent)
    assert old.billed_to == "tenant" and m.usage_msg_id(old) == "r1"


def test_rollup_values_parse_back_into_totals() -> None:
    import msgspec

    fields = {b"g1": msgspec.msgpack.encode([2, 1, 0, 10, 4, 6, 7, 8, 9]),
              "g2": msgspec.msgpack.encode([1.0, 0, 1, 1, 0, 1, 1, 0, 1])}  # Lua may pack doubles
    parsed = u.parse_rollup(fields)
    assert parsed["g1"] == u.Totals(2, 1, 0, 10, 4, 6, 7, 8, 9)
    assert parsed["g1"].cost == 24
    total = u.Totals()
    for t in parsed.values():
        total.add(t)
    assert total == u.Totals(3, 1, 1, 11, 4, 7, 8, 8, 10)


def group(model: str = MODEL, adapter: str = "", band: str = "standard", key: str = "key_1", batch: str = "") -> str:
    return u.GROUP_SEP.join((model, adapter, band, key, batch))


ROLLUPS = {
    "acme": {group(): u.Totals(2, 0, 0, 200, 80, 100, 72, 12, 90),
             group(key="key_2"): u.Totals(1, 1, 0, 50, 0, 10, 30, 0, 9),
             group(adapter="lora-a", batch="batch_1"): u.Totals(1, 0, 0, 10, 0, 10, 3, 0, 5)},
    "beta": {group(key="key_9"): u.Totals(5, 0, 1, 500, 0, 500, 300, 0, 450)},
}


def test_regroup_sums_groups_and_applies_filters() -> None:
    query = u.UsageQuery(start=0, end=86400, width="1d", group_by=("api_key_id",))
    acme = u.regroup({"acme": ROLLUPS["acme"]}, query)
    assert acme[("key_1",)].requests == 3 and acme[("key_1",)].input_tokens == 210
    assert acme[("key_2",)].cancelled == 1
    everything = u.regroup(ROLLUPS, u.UsageQuery(start=0, end=86400, width="1d"))
    assert list(everything) == [()] and everything[()].requests == 9
    by_batch = u.regroup({"acme": ROLLUPS["acme"]}, u.UsageQuery(start=0, end=86400, width="1d", group_by=("batch",)))
    assert by_batch[(True,)].requests == 1 and by_batch[(False,)].requests == 3
    filtered = u.regroup(ROLLUPS, u.UsageQuery(start=0, end=86400, width="1d", api_key_ids=("key_9",)))
    assert filtered[()].requests == 5
    by_tenant = u.regroup(ROLLUPS, u.UsageQuery(start=0, end=86400, width="1d", group_by=("tenant", "model")))
    assert set(by_tenant) == {("acme", MODEL), ("beta", MODEL)}


def test_usage_results_have_openais_shape() -> None:
    query = u.UsageQuery(start=0, end=86400, width="1d", group_by=("model", "api_key_id", "adapter"))
    results = u.usage_results(u.regroup({"acme": ROLLUPS["acme"]}, query), query.group_by)
    first = results[0]
    assert first["object"] == "organization.usage.completions.result"
    assert {"input_tokens", "output_tokens", "input_cached_tokens", "input_audio_tokens", "output_audio_tokens",
            "num_model_requests", "project_id", "user_id", "api_key_id", "model", "batch"} <= set(first)
    assert first["model"] == MODEL and first["batch"] is None and "band" not in first
    assert sum(r["num_model_requests"] for r in results) == 4
    ungrouped = u.usage_results(u.regroup({"acme": ROLLUPS["acme"]}, u.UsageQuery(0, 86400, "1d")), ())
    assert ungrouped[0]["model"] is None and ungrouped[0]["input_tokens"] == 260


def test_cost_results_split_into_line_items_that_sum_to_the_total() -> None:
    plain = u.cost_results(u.regroup({"acme": ROLLUPS["acme"]}, u.UsageQuery(0, 86400, "1d")), ())
    assert plain == [{"object": "organization.costs.result", "amount": {"value": 0.000221, "currency": "usd"},
                      "line_item": None, "project_id": None, "user_id": None, "api_key_id": None, "model": None,
                      "batch": None}]
    query = u.UsageQuery(0, 86400, "1d", group_by=("line_item",))
    items = u.cost_results(u.regroup({"acme": ROLLUPS["acme"]}, query), query.group_by)
    assert [i["line_item"] for i in items] == ["input", "cached input", "output"]
    assert round(sum(i["amount"]["value"] for i in items) * 1e6) == 221
    query = u.UsageQuery(0, 86400, "1d", group_by=("model", "line_item"))
    assert (
        u.cost_results(u.regroup({"acme": ROLLUPS["acme"]}, query), query.group_by)[0]["line_item"] == f"{MODEL}, input"
    )


def test_usd_text_is_exact() -> None:
    assert (
        u.usd_text(105) == "0.000105" and u.usd_text(0) == "0.000000" and u.usd_text(12_345_678_901) == "12345.678901"
    )


# ---- queries, buckets and pages -----------------------------------------------------------------

NOW = 1_790_000_000  # 2026-09-21T14:53:20Z


def q(kind: u.Kind = "usage", admin: bool = False, **params: object) -> u.UsageQuery:
    items: list[tuple[str, str]] = []
    for key, value in params.items():
        for one in value if isinstance(value, list) else [value]:
            items.append((key, str(one)))
    return u.parse_query(items, now=NOW, kind=kind, admin=admin)


def test_bucket_math_aligns_to_utc_boundaries() -> None:
    assert u.floor_to(1_790_000_123, 3600) == 1_789_999_200
    assert u.ceil_to(1_789_999_200, 3600) == 1_789_999_200 and u.ceil_to(1_789_999_201, 3600) == 1_790_002_800
    day = calendar.timegm((2026, 10, 5, 0, 0, 0))
    assert u.floor_to(day + 86399, 86400) == day


def test_query_defaults_and_rounding() -> None:
    query = q(start_time=1_790_000_123, end_time=1_790_090_000)
    assert query.width == "1d" and query.limit == 7 and query.group_by == ()
    assert query.start == u.floor_to(1_790_000_123, 86400) and query.end == u.ceil_to(1_790_090_000, 86400)
    assert q(start_time=0, bucket_width="1h").limit == 24 and q(start_time=NOW - 60, bucket_width="1m").limit == 60
    assert q(start_time=0).end >= NOW  # end_time defaults to now


@pytest.mark.parametrize("params, param", [
    ({}, "start_time"),
    ({"start_time": "yesterday"}, "start_time"),
    ({"start_time": 100, "end_time": 50}, "end_time"),
    ({"start_time": 0, "bucket_width": "1w"}, "bucket_width"),
    ({"start_time": 0, "limit": 32}, "limit"),
    ({"start_time": 0, "bucket_width": "1h", "limit": 0}, "limit"),
    ({"start_time": 0, "group_by": "colour"}, "group_by"),
    ({"start_time": 0, "group_by": "tenant"}, "group_by"),  # admin only
    ({"start_time": 0, "group_by": "line_item"}, "group_by"),  # costs only
    ({"start_time": 0, "page": "nonsense"}, "page"),
    ({"start_time": 0, "tenant": "acme"}, "tenant"),  # admin only
    ({"start_time": NOW - 3 * 86400, "bucket_width": "1m"}, "start_time"),  # past minute retention
    ({"start_time": [0, 1]}, "start_time"),
])
def test_bad_parameters_name_themselves(params: dict[str, object], param: str) -> None:
    with pytest.raises(u.QueryError) as raised:
        q(**params)
    assert raised.value.param == param


def test_group_by_accepts_lists_repeats_and_aliases() -> None:
    assert q(start_time=0, group_by="model,api_key").group_by == ("model", "api_key_id")
    assert q(start_time=0, group_by=["batch", "model", "batch"]).group_by == ("batch", "model")
    assert u.parse_query([("start_time", "0"), ("group_by[]", "api_key_id")], now=NOW).group_by == ("api_key_id",)
    assert q("costs", admin=True, start_time=0, group_by="project_id,line_item").group_by == ("tenant", "line_item")
    assert q(admin=True, start_time=0, tenant="acme,beta").tenants == ("acme", "beta")


def test_cursors_round_trip_and_walk_every_bucket_once() -> None:
    assert u.decode_cursor(u.encode_cursor(1_790_006_400)) == 1_790_006_400
    start = 1_789_948_800  # a UTC midnight
    seen: list[int] = []
    page: str | None = None
    pages = 0
    while True:
        params: dict[str, object] = {"start_time": start + 5, "end_time": start + 10 * 3600 + 1, "bucket_width": "1h",
                                     "limit": 3}
        if page:
            params["page"] = page
        starts, page = u.page_buckets(q(**params))
        seen += starts
        pages += 1
        if page is None:
            break
    assert seen == [start + i * 3600 for i in range(11)] and pages == 4
    body = u.page_body([(start, [])], "1h", "page_x")
    assert body == {"object": "page", "data": [{"object": "bucket", "start_time": start, "end_time": start + 3600,
                                                "results": []}], "has_more": True, "next_page": "page_x"}


def test_a_cursor_of_another_query_is_refused() -> None:
    cursor = u.encode_cursor(1_790_006_400 + 1800)  # not on an hour boundary
    with pytest.raises(u.QueryError):
        q(start_time=1_790_000_000, bucket_width="1h", page=cursor)
    with pytest.raises(u.QueryError):
        q(start_time=1_790_000_000, end_time=1_790_003_000, bucket_width="1h", page=u.encode_cursor(1_799_996_400))


# ---- exports --------------------------------------------------------------------------------------

def rows() -> list[dict[str, object]]:
    groups = u.regroup({"acme": ROLLUPS["acme"]}, u.UsageQuery(0, 3600, "1h", group_by=u.EXPORT_GROUP_BY))
    return u.export_rows(1_789_999_200, "1h", groups, u.EXPORT_GROUP_BY, "acme")


def test_export_rows_carry_every_column_and_exact_dollars() -> None:
    found = rows()
    assert len(found) == 3 and all(tuple(r) == u.EXPORT_COLUMNS for r in found)
    assert found[0]["bucket_start"] == "2026-09-21T14:00:00Z" and found[0]["end_time"] == 1_789_999_200 + 3600
    assert sum(r["cost_micro_usd"] for r in found) == 221  # type: ignore[misc]
    assert {r["cost_usd"] for r in found} == {"0.000174", "0.000039", "0.000008"}


def test_csv_and_jsonl_exports(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    write_rows(rows(), "csv", buffer)
    parsed = list(csv.DictReader(io.StringIO(buffer.getvalue().decode())))
    assert [r["cost_usd"] for r in parsed] == [r["cost_usd"] for r in rows()]
    assert parsed[0]["adapter"] == "" and parsed[2]["batch_id"] == "batch_1"
    write_rows(rows(), "jsonl", tmp_path / "x.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    assert lines == rows()


@pytest.mark.slow
def test_parquet_exports_keep_integers_and_exact_dollars(tmp_path: Path) -> None:
    from decimal import Decimal

    import pyarrow.parquet as pq

    write_rows(rows(), "parquet", tmp_path / "x.parquet")
    table = pq.read_table(tmp_path / "x.parquet").to_pylist()
    assert [r["input_tokens"] for r in table] == [r["input_tokens"] for r in rows()]
    assert sum(r["cost_usd"] for r in table) == Decimal("0.000221")


def test_months() -> None:
    start, end = month_range("2026-12")
    assert start == calendar.timegm((2026, 12, 1, 0, 0, 0)) and end == calendar.timegm((2027, 1, 1, 0, 0, 0))
    assert previous_month(calendar.timegm((2027, 1, 1, 0, 30, 0))) == "2026-12"
    with pytest.raises(ValueError):
        month_range("2026-13")


def test_the_monthly_export_is_due_after_the_delay_into_the_new_month() -> None:
    from services.billing.export import MonthlyExporter

    exporter = MonthlyExporter(None, Path("."), fmt="csv", width="1h", delay_s=1800,  # type: ignore[arg-type]
                               caught_up=lambda: asyncio.sleep(0, True), clock=lambda: 0.0)
    first = calendar.timegm((2026, 11, 1, 0, 0, 0))
    assert exporter.due(first + 1799) is None
    assert exporter.due(first + 1800) == "2026-10"
    assert exporter.due(first + 20 * 86400) == "2026-10"  # a billing service that was down catches up


# ---- the ledger puller ----------------------------------------------------------------------------

def test_num_pending_reads_both_ack_subject_forms() -> None:
    assert num_pending(b"$JS.ACK.USAGE.usage-rollup.1.42.40.1790000000000000000.17") == 17
    assert num_pending(b"$JS.ACK.hub.ACCHASH.USAGE.usage-rollup.1.42.40.1790000000000000000.5.rnd") == 5
    assert num_pending(b"garbage") == -1


def test_the_puller_parses_frames_split_anywhere() -> None:
    connection = PullConnection("nats://127.0.0.1:1", "USAGE", "usage-rollup")
    connection.outstanding = 10
    inbox = connection.inbox

    def hmsg(reply: bytes, headers: bytes, payload: bytes) -> bytes:
        size = b"%d %d" % (len(headers), len(headers) + len(payload))
        return (
            b"HMSG " + inbox + b" 1 " + (reply + b" " if reply else b"") + size + b"\r\n" + headers + payload + b"\r\n"
        )

    frames = (
        b"PING\r\n"
        + hmsg(b"$JS.ACK.USAGE.c.1.1.1.1.9", b"NATS/1.0\r\nNats-Msg-Id: r1\r\n\r\n", b"hello")
        + hmsg(b"$JS.ACK.USAGE.c.1.2.2.1.8", b"NATS/1.0\r\n\r\n", b"world")
        + hmsg(b"", b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 7\r\nNats-Pending-Bytes: 0\r\n\r\n", b"")
    )
    for cut in range(1, len(frames)):
        connection.buffer.clear()
        connection.outstanding = 10
        used = connection._parse(frames[:cut])
        rest = frames[used:cut] + frames[cut:]
        connection._parse(rest)
        assert [d.data for d in connection.buffer] == [b"hello", b"world"], cut
        assert connection.outstanding == 1  # 10 asked, 2 delivered, 7 given up
    assert connection.buffer[1].reply == b"$JS.ACK.USAGE.c.1.2.2.1.8"


def test_the_puller_notices_a_missing_consumer() -> None:
    connection = PullConnection("nats://127.0.0.1:1", "USAGE", "usage-rollup")
    connection.outstanding = 5
    body = b'{"type":"io.nats.jetstream.api.v1.consumer_msg_next_response","error":{"code":404}}'
    connection._parse(b"MSG " + connection.inbox + b" 1 %d\r\n%s\r\n" % (len(body), body))
    assert connection.consumer_missing and connection.outstanding == 0
    deleted = PullConnection("nats://127.0.0.1:1", "USAGE", "usage-rollup")
    headers = b"NATS/1.0 409 Consumer Deleted\r\n\r\n"
    deleted._parse(b"HMSG " + deleted.inbox + b" 1 %d %d\r\n%s\r\n" % (len(headers), len(headers), headers))
    assert deleted.consumer_missing
