"""Listing a KV bucket's keys (inferbus.bus.kv_keys) against a real nats-server: complete right
after a write, deleted keys left to the caller, an empty bucket an empty list."""

from __future__ import annotations

from nats.aio.client import Client
from nats.js.api import KeyValueConfig

from inferbus import adapters as registry
from inferbus import bus

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
