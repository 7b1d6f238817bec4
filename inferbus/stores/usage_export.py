"""Usage exports' rows and files: the one code path behind `inferbus usage export`, the monthly
export files and the web console's usage page and CSV download.

`collect_rows` pages through a period's rollups (one tenant at a time, so memory stays bounded by
the rows returned) and turns every non-empty bucket's groups into export rows
(`usage.export_rows`, every column of `usage.EXPORT_COLUMNS`); `write_rows` writes them as CSV,
JSONL or Parquet.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from inferbus.runtime.extras import require
from inferbus.stores import usage as u
from inferbus.stores.billing import UsageStore

FORMATS = ("csv", "jsonl", "parquet")


async def collect_rows(store: UsageStore, tenants: Sequence[str], start: int, end: int, width: str = "1h",
                    group_by: Sequence[str] = u.EXPORT_GROUP_BY,
                    on_page: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Every non-empty bucket's rows in [start, end) for `tenants`, one tenant at a time."""
    rows: list[dict[str, Any]] = []
    epoch = await store.state.epoch()
    limit = u.PAGE_LIMITS[width][1]
    for tenant in tenants:
        query = u.UsageQuery(start=u.floor_to(start, u.WIDTHS[width]), end=u.ceil_to(end, u.WIDTHS[width]),
                             width=width, group_by=tuple(group_by), limit=limit)
        while True:
            buckets, cursor = await store.query(query, [tenant], epoch)
            for bucket_start, groups in buckets:
                rows += u.export_rows(bucket_start, width, groups, group_by, tenant)
            if on_page is not None:
                on_page(len(buckets))
            if cursor is None:
                break
            query = u.UsageQuery(start=query.start, end=query.end, width=width, group_by=query.group_by,
                                 limit=limit, page=u.decode_cursor(cursor))
    return rows


def write_rows(rows: Sequence[dict[str, Any]], fmt: str, out: IO[bytes] | Path) -> None:
    """Write `rows` (every column of `usage.EXPORT_COLUMNS`) as `fmt` to a binary file or a path."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if fmt == "parquet":
        _write_parquet(rows, out)
        return
    if isinstance(out, Path):
        with open(out, "wb") as handle:
            write_rows(rows, fmt, handle)
        return
    text = io.TextIOWrapper(out, encoding="utf-8", newline="", write_through=True)
    try:
        if fmt == "csv":
            writer = csv.DictWriter(text, fieldnames=u.EXPORT_COLUMNS, lineterminator="\n")
            writer.writeheader()
            for row in rows:
                writer.writerow({k: "" if v is None else v for k, v in row.items()})
        else:
            for row in rows:
                text.write(json.dumps(row, separators=(",", ":")) + "\n")
        text.flush()
    finally:
        text.detach()  # leave `out` open for its owner


def _write_parquet(rows: Sequence[dict[str, Any]], out: IO[bytes] | Path) -> None:
    from decimal import Decimal

    pa = require("pyarrow", "parquet", "Parquet exports")
    import pyarrow.parquet as pq

    strings = ("tenant", "bucket_start", "model", "adapter", "band", "api_key_id", "batch_id", "release")
    schema = pa.schema([
        (name, pa.string() if name in strings else pa.decimal128(20, 6) if name == "cost_usd" else pa.int64())
        for name in u.EXPORT_COLUMNS
    ])
    columns = {name: [row[name] for row in rows] for name in u.EXPORT_COLUMNS}
    columns["cost_usd"] = [Decimal(v) for v in columns["cost_usd"]]
    table = pa.table(columns, schema=schema)
    pq.write_table(table, out if isinstance(out, Path) else pa.PythonFile(out, mode="w"))
