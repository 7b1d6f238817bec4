"""Listing a KV bucket's keys and values (inferbus.bus.connection.kv_keys, kv_values) against a real
nats-server: complete right after a write, deleted keys left to the caller (keys) or left out
(values), an empty bucket an empty list; and the listings built on them."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js.api import KeyValueConfig

from inferbus.bus import connection as bus
from inferbus.stores import adapters as registry
from inferbus.stores.files import FileStore

pytestmark = pytest.mark.slow

DIGEST = "sha256:" + "cd" * 32


async def test_keys_are_listed_completely_at_once_after_each_write(nc: Client) -> None:
    kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket="listing"))
    assert await bus.kv_keys(kv) == []
    await kv.put("rollout.m", b"r")
    for i in range(40):
        await kv.put(f"release.{i:02d}", b"x")
        assert await bus.kv_keys(kv, "release.>") == [f"release.{j:02d}" for j in range(i + 1)]
    await kv.delete("release.00")
    listed = await bus.kv_keys(kv)
    assert "rollout.m" in listed and "release.00" in listed and len(listed) == 41


async def test_registered_adapters_are_listed_without_the_deleted_ones(nc: Client) -> None:
    kv = await registry.bucket(nc.jetstream())
    assert await registry.list_all(kv) == []
    for name in ("a-bot", "b-bot", "c-bot"):
        await registry.put(kv, registry.new_spec(name, "base", DIGEST, f"/adapters/{name}"))
    assert await registry.delete(kv, "b-bot")
    assert [spec.name for spec in await registry.list_all(kv)] == ["a-bot", "c-bot"]


async def test_values_are_listed_completely_at_once_without_the_deleted_ones(nc: Client) -> None:
    kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket="values"))
    assert await bus.kv_values(kv) == []
    for i in range(150):  # more than the reads kept in flight at once
        await kv.put(f"item.{i:03d}", b"v%d" % i)
    await kv.put("item.007", b"rewritten")
    await kv.delete("item.003")
    entries = await bus.kv_values(kv, "item.>")
    assert [entry.key for entry in entries] == [f"item.{i:03d}" for i in range(150) if i != 3]
    assert entries[6].value == b"rewritten" and entries[0].value == b"v0"


async def test_a_tenants_files_are_listed_right_after_each_upload(nc: Client, tmp_path: Path) -> None:
    _, files_kv = await bus.batch_buckets(nc.jetstream())
    store = FileStore(tmp_path, files_kv)
    created = []
    for i in range(25):
        record = await store.create("acme", f"f{i}.jsonl", "batch", io.BytesIO(b"{}\n"))
        created.append(record.id)
        assert sorted(r.id for r in await store.all("acme")) == sorted(created)
    await store.create("other", "theirs.jsonl", "batch", io.BytesIO(b"{}\n"))
    assert await store.delete("acme", created[0])
    assert sorted(r.id for r in await store.all("acme")) == sorted(created[1:])
