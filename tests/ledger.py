"""What the billing service holds, read the way an auditor would: its rollups through the admin
API, the ledger (the `USAGE` stream) as a list of every event on it (duplicates kept), and whether
its consumer has caught up. Shared by the end-to-end billing checks."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from proto import messages as m
from proto import subjects

from .conftest import Platform


def new_tenant(platform: Platform, keys: int = 1) -> tuple[str, list[tuple[str, str]]]:
    """A tenant of its own with `keys` API keys: (tenant id, [(secret, key id), ...])."""
    tenant = platform.create_tenant()
    return tenant, [platform.new_key(tenant) for _ in range(keys)]


def rollups_by_key(platform: Platform, tenant: str, start: float, end: float) -> dict[str, dict[str, int]]:
    """The billing service's usage rollups of `tenant` per API key id: requests, input, cached and
    output tokens, summed over the buckets between `start` and `end`."""
    with platform.admin() as admin:
        response = admin.get("/usage", params={"tenant": tenant, "start_time": int(start) - 60,
                                               "end_time": int(end) + 61, "bucket_width": "1d", "limit": 31,
                                               "group_by": "api_key_id"})
    assert response.status_code == 200, response.text
    out: dict[str, dict[str, int]] = {}
    for bucket in response.json()["data"]:
        for r in bucket["results"]:
            row = out.setdefault(r["api_key_id"], {"requests": 0, "input": 0, "cached": 0, "output": 0})
            row["requests"] += r["num_model_requests"]
            row["input"] += r["input_tokens"]
            row["cached"] += r["input_cached_tokens"]
            row["output"] += r["output_tokens"]
    return out


def ledger(platform: Platform, tenant: str) -> list[m.UsageEvent]:
    """Every usage event of `tenant` on the ledger, in stream order, duplicates kept."""
    import nats

    async def read() -> list[m.UsageEvent]:
        nc = await nats.connect(platform.stack.nats_url)
        try:
            events: list[m.UsageEvent] = []
            sub = await nc.jetstream().subscribe(subjects.usage_filter(tenant), ordered_consumer=True)
            try:
                while True:  # until the consumer has nothing left (none at all: a quiet second)
                    try:
                        msg = await sub.next_msg(timeout=1.0)
                    except Exception:
                        break
                    events.append(msgspec.msgpack.decode(msg.data, type=m.UsageEvent))
                    if msg.metadata.num_pending == 0:
                        break
            finally:
                await sub.unsubscribe()
            return events
        finally:
            await nc.close()

    return asyncio.run(read())


def rollup_drained(platform: Platform) -> bool:
    """The billing service's consumer has rolled up everything on the ledger."""
    import nats

    async def check() -> bool:
        nc = await nats.connect(platform.stack.nats_url)
        try:
            info = await nc.jetstream().consumer_info(subjects.USAGE_STREAM, "usage-rollup")
            return info.num_pending == 0 and info.num_ack_pending == 0
        finally:
            await nc.close()

    return asyncio.run(check())


def outbox_pending(path: Any) -> int:
    """Usage events in a service's outbox file not yet acknowledged by JetStream (0: no file)."""
    import sqlite3
    from pathlib import Path

    if not Path(path).exists():
        return 0
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        return int(db.execute("SELECT COUNT(*) FROM pending").fetchone()[0])
    finally:
        db.close()
