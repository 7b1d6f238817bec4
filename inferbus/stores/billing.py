"""Billing state in Redis: usage rollups (idempotent ingest, one Lua call per tenant per batch), the
price book and the rollup epoch.

Keys (the hash tag `{t:<tenant>}` keeps a tenant's rollups in one Redis Cluster slot; `{billing}`
keeps the global records together):

    inferbus:{billing}:epoch                       generation of the rollups (bumped by a rebuild)
    inferbus:{billing}:config                      hash: settings readers need (minute retention)
    inferbus:{billing}:prices                      hash: one price version per field (JSON)
    inferbus:{billing}:prices:version              bumped on every price change
    inferbus:{billing}:tenants                     set: tenants that ever had usage
    inferbus:{billing}:rebuilding                  set while a rebuild runs (exports wait)
    inferbus:{billing}:exported:<YYYY-MM>          the monthly export of that month is written
    inferbus:{t:<tenant>}:usage:<epoch>:h:<start>  hash: hourly rollup, group -> msgpack
                                                   [n, nc, nf, in, cin, out, $in, $cin, $out]
    inferbus:{t:<tenant>}:usage:<epoch>:d:<start>  the same per UTC day
    inferbus:{t:<tenant>}:usage:<epoch>:m:<start>  the same per minute (kept `minute_retention_s`)
    inferbus:{t:<tenant>}:usage:<epoch>:seen:<hour> set: request ids already counted (by accept hour)

Exactly once: the ingest script adds a request id to its dedup set and, only if it was not there,
adds the event to its rollups, in one atomic script. Redelivered or duplicated events (same
request id, any stream sequence) are counted once; so are events that several billing replicas
race on. A rebuild writes a new epoch from scratch, so a writer still busy with the old one
cannot leave half a count behind (see docs/billing.md for the argument).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import redis.asyncio as aioredis

from inferbus.runtime.redis_conn import rerun_unloaded
from inferbus.stores import usage as u
from inferbus.stores.pricing import PriceBook, Prices, PriceVersion

BILLING = "inferbus:{billing}:"
EPOCH_KEY = BILLING + "epoch"
CONFIG_KEY = BILLING + "config"
PRICES_KEY = BILLING + "prices"
PRICES_VERSION_KEY = BILLING + "prices:version"
TENANTS_KEY = BILLING + "tenants"
REBUILDING_KEY = BILLING + "rebuilding"

DEFAULT_MINUTE_RETENTION_S = 48 * 3600
DEFAULT_ROLLUP_RETENTION_S = 400 * 86400
DEFAULT_DEDUP_TTL_S = 8 * 86400
# Events per ingest script call and per round trip: bound how long Redis serves billing alone
# (a script, and a pipeline, run without other clients' commands in between).
MAX_EVENTS_PER_CALL = 256
MAX_EVENTS_PER_ROUND_TRIP = 512


def exported_key(month: str) -> str:
    return BILLING + f"exported:{month}"


def export_lock_key(month: str) -> str:
    return BILLING + f"export-lock:{month}"


def usage_prefix(tenant: str, epoch: int) -> str:
    return f"inferbus:{{t:{tenant}}}:usage:{epoch}:"


_KIND = {"1m": "m", "1h": "h", "1d": "d"}
_encoder = msgspec.msgpack.Encoder()

# KEYS[1]: the tenant's usage prefix for the current epoch
# ARGV: now, minute_retention_s, rollup_retention_s, dedup_ttl_s, and the events as one msgpack
#       array of [request_id, started, group, status, input, cached, output, $input, $cached, $output]
# A rollup hash has one field per group whose value is its nine counters as a msgpack array.
# Returns one character per event: "1" counted now, "0" counted before (a duplicate).
INGEST = r"""
local prefix = KEYS[1]
local now = tonumber(ARGV[1])
local minute_keep, rollup_keep, seen_keep = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local events = cmsgpack.unpack(ARGV[5])
-- 1. Dedup, and sum the new events per (minute, group): one addition per event.
local per_minute, minutes = {}, {}
local flags, seen_sets, seen_keys = {}, {}, {}
for i, e in ipairs(events) do
  local started = e[2]
  local hour = started - started % 3600
  local seen = seen_keys[hour]
  if not seen then
    seen = prefix .. 'seen:' .. hour
    seen_keys[hour] = seen
  end
  if redis.call('SADD', seen, e[1]) == 1 then
    seen_sets[seen] = true
    local minute = started - started % 60
    local groups = per_minute[minute]
    if not groups then
      groups = {}
      per_minute[minute] = groups
      minutes[#minutes + 1] = minute
    end
    local group = e[3]
    local t = groups[group]
    if not t then
      t = {0, 0, 0, 0, 0, 0, 0, 0, 0}
      groups[group] = t
    end
    t[1] = t[1] + 1
    if e[4] == 1 then t[2] = t[2] + 1 elseif e[4] == 2 then t[3] = t[3] + 1 end
    t[4], t[5], t[6] = t[4] + e[5], t[5] + e[6], t[6] + e[7]
    t[7], t[8], t[9] = t[7] + e[8], t[8] + e[9], t[9] + e[10]
    flags[i] = '1'
  else
    flags[i] = '0'
  end
end
-- 2. Those sums into the minute, hour and day buckets (far fewer than events).
local acc, expire_at, order = {}, {}, {}
local function add(key, until_ts, group, v)
  local groups = acc[key]
  if not groups then
    groups = {}
    acc[key] = groups
    expire_at[key] = until_ts
    order[#order + 1] = key
  end
  local t = groups[group]
  if not t then
    groups[group] = {v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9]}
  else
    for j = 1, 9 do t[j] = t[j] + v[j] end
  end
end
for _, minute in ipairs(minutes) do
  local hour = minute - minute % 3600
  local day = minute - minute % 86400
  for group, v in pairs(per_minute[minute]) do
    if minute + minute_keep > now then add(prefix .. 'm:' .. minute, minute + minute_keep, group, v) end
    if hour + rollup_keep > now then add(prefix .. 'h:' .. hour, hour + rollup_keep, group, v) end
    if day + rollup_keep > now then add(prefix .. 'd:' .. day, day + rollup_keep, group, v) end
  end
end
-- 3. One read and one write per bucket: a group's counters are one msgpack array.
for _, key in ipairs(order) do
  local groups, names = acc[key], {}
  for group in pairs(groups) do names[#names + 1] = group end
  -- Chunks keep unpack() far below Lua's C stack limit.
  for first = 1, #names, 500 do
    local chunk = {}
    for k = first, math.min(#names, first + 499) do chunk[#chunk + 1] = names[k] end
    local current = redis.call('HMGET', key, unpack(chunk))
    local writes = {}
    for k, group in ipairs(chunk) do
      local t = groups[group]
      if current[k] then
        local old = cmsgpack.unpack(current[k])
        for j = 1, 9 do t[j] = t[j] + old[j] end
      end
      writes[#writes + 1] = group
      writes[#writes + 1] = cmsgpack.pack(t)
    end
    redis.call('HSET', key, unpack(writes))
  end
  redis.call('EXPIREAT', key, string.format('%d', expire_at[key]))
end
for key in pairs(seen_sets) do redis.call('EXPIRE', key, seen_keep) end
return table.concat(flags)
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class BillingState:
    """The small global records every reader and writer looks at first."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis

    async def epoch(self) -> int:
        raw = await self.redis.get(EPOCH_KEY)
        return int(raw) if raw is not None else 0

    async def snapshot(self) -> tuple[int, int, int]:
        """(epoch, price-book version, minute retention in seconds), in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(EPOCH_KEY)
        pipe.get(PRICES_VERSION_KEY)
        pipe.hget(CONFIG_KEY, "minute_retention_s")
        epoch, version, minutes = await pipe.execute()
        return (int(epoch) if epoch is not None else 0, int(version) if version is not None else 0,
                int(minutes) if minutes is not None else DEFAULT_MINUTE_RETENTION_S)

    async def publish_config(self, minute_retention_s: int) -> None:
        await self.redis.hset(CONFIG_KEY, "minute_retention_s", minute_retention_s)

    async def bump_epoch(self) -> int:
        return int(await self.redis.incr(EPOCH_KEY))

    async def mark_rebuilding(self, on: bool) -> None:
        """A rebuild is running (the mark expires by itself if the rebuild dies)."""
        if on:
            await self.redis.set(REBUILDING_KEY, "1", ex=300)
        else:
            await self.redis.delete(REBUILDING_KEY)

    async def rebuilding(self) -> bool:
        return bool(await self.redis.exists(REBUILDING_KEY))


class PriceStore:
    """The versioned price book in Redis. The billing service seeds the `*`/`*` entry from its
    settings once; operators add versions through the admin API (`inferbus prices set`)."""

    def __init__(self, redis: aioredis.Redis, default: Prices | None = None) -> None:
        self.redis = redis
        self.default = default
        self._book: PriceBook | None = None
        self._version = -1

    async def seed(self, prices: Prices) -> bool:
        """Store `prices` as the `*`/`*` version effective from the epoch, unless there is one."""
        version = PriceVersion("*", "*", 0.0, prices, created=time.time())
        if await self.redis.hsetnx(PRICES_KEY, version.field(), json.dumps(version.to_dict())):
            await self.redis.incr(PRICES_VERSION_KEY)
            return True
        return False

    async def put(self, version: PriceVersion) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(PRICES_KEY, version.field(), json.dumps(version.to_dict()))
        pipe.incr(PRICES_VERSION_KEY)
        await pipe.execute()

    async def load(self) -> tuple[int, PriceBook]:
        pipe = self.redis.pipeline(transaction=True)
        pipe.get(PRICES_VERSION_KEY)
        pipe.hgetall(PRICES_KEY)
        raw_version, entries = await pipe.execute()
        versions = [PriceVersion.from_dict(json.loads(value)) for value in entries.values()]
        return (int(raw_version) if raw_version is not None else 0), PriceBook(versions, self.default)

    async def book(self, version: int | None = None) -> PriceBook:
        """The current book, reloaded only when its version changed (pass it if already known)."""
        if version is None:
            raw = await self.redis.get(PRICES_VERSION_KEY)
            version = int(raw) if raw is not None else 0
        if self._book is None or version != self._version:
            self._version, self._book = await self.load()
        return self._book


class UsageStore:
    def __init__(self, redis: aioredis.Redis, *, minute_retention_s: int = DEFAULT_MINUTE_RETENTION_S,
                 rollup_retention_s: int = DEFAULT_ROLLUP_RETENTION_S, dedup_ttl_s: int = DEFAULT_DEDUP_TTL_S) -> None:
        self.redis = redis
        self.state = BillingState(redis)
        self.minute_retention_s = minute_retention_s
        self.rollup_retention_s = rollup_retention_s
        self.dedup_ttl_s = dedup_ttl_s
        self._ingest = redis.register_script(INGEST)

    # ---- writing --------------------------------------------------------------------------------

    async def ingest(self, contributions: Sequence[u.Contribution], epoch: int, now: float | None = None) -> list[bool]:
        """Add each event to its rollups unless its request id was counted before; True where added.

        One script call per tenant (per `MAX_EVENTS_PER_CALL` of its events), pipelined, a round
        trip per `MAX_EVENTS_PER_ROUND_TRIP` events.
        """
        if not contributions:
            return []
        now_s = int(time.time() if now is None else now)
        by_tenant: dict[str, list[int]] = {}
        for index, c in enumerate(contributions):
            by_tenant.setdefault(c.tenant, []).append(index)
        calls: list[tuple[str, list[int], list[Any]]] = []
        head = [now_s, self.minute_retention_s, self.rollup_retention_s, self.dedup_ttl_s]
        for tenant, indices in by_tenant.items():
            prefix = usage_prefix(tenant, epoch)
            # A script blocks every other Redis client while it runs (the gateways' admission
            # calls among them), so a tenant's events go in chunks of a bounded size.
            for first in range(0, len(indices), MAX_EVENTS_PER_CALL):
                chunk = indices[first:first + MAX_EVENTS_PER_CALL]
                # One msgpack argument per call: packing ten arguments per event cost redis-py
                # more CPU than everything else in the consumer.
                events = _encoder.encode([contributions[index].row for index in chunk])
                calls.append((prefix, chunk, [*head, events]))
        # Redis runs a client's pipelined commands back to back, so one round trip carries a
        # bounded amount of work: other clients (the gateways' admission calls) get a turn between.
        results: list[Any] = []
        start = 0
        while start < len(calls):
            end, in_trip = start, 0
            while end < len(calls) and (end == start or in_trip + len(calls[end][1]) <= MAX_EVENTS_PER_ROUND_TRIP):
                in_trip += len(calls[end][1])
                end += 1
            results += await self._run(calls[start:end], list(by_tenant) if start == 0 else [])
            start = end
        counted = [False] * len(contributions)
        for (_, indices, _), flags in zip(calls, results):
            text = _text(flags)
            for index, flag in zip(indices, text):
                counted[index] = flag == "1"
        return counted

    async def _run(self, calls: list[tuple[str, list[int], list[Any]]], tenants: list[str]) -> list[Any]:
        sha = self._ingest.sha
        pipe = self.redis.pipeline(transaction=False)
        for prefix, _, args in calls:
            pipe.execute_command("EVALSHA", sha, 1, prefix, *args)
        if tenants:
            pipe.sadd(TENANTS_KEY, *tenants)
        results = (await pipe.execute(raise_on_error=False))[:len(calls)]
        results = await rerun_unloaded(
            self.redis, INGEST, [("EVALSHA", sha, 1, prefix, *args) for prefix, _, args in calls], results
        )
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results

    # ---- reading --------------------------------------------------------------------------------

    async def tenants(self) -> list[str]:
        return sorted(_text(t) for t in await self.redis.smembers(TENANTS_KEY))

    async def read(self, tenants: Sequence[str], width: str, starts: Sequence[int],
                   epoch: int | None = None) -> dict[int, dict[str, dict[str, u.Totals]]]:
        """{bucket start: {tenant: {group: Totals}}} for the given buckets (empty ones left out)."""
        if epoch is None:
            epoch = await self.state.epoch()
        kind = _KIND[width]
        out: dict[int, dict[str, dict[str, u.Totals]]] = {}
        if not tenants or not starts:
            return out
        pipe = self.redis.pipeline(transaction=False)
        order = []
        for tenant in tenants:
            prefix = usage_prefix(tenant, epoch)
            for start in starts:
                pipe.hgetall(f"{prefix}{kind}:{start}")
                order.append((tenant, start))
        for (tenant, start), fields in zip(order, await pipe.execute()):
            if fields:
                out.setdefault(start, {})[tenant] = u.parse_rollup(fields)
        return out

    async def query(self, query: u.UsageQuery, tenants: Sequence[str] | None = None,
                    epoch: int | None = None) -> tuple[list[tuple[int, dict[u.GroupValues, u.Totals]]], str | None]:
        """One page of `query`: [(bucket start, {group values: Totals})], next cursor."""
        starts, next_page = u.page_buckets(query)
        if tenants is None:
            tenants = list(query.tenants) or await self.tenants()
        rollups = await self.read(tenants, query.width, starts, epoch)
        return [(start, u.regroup(rollups.get(start, {}), query)) for start in starts], next_page

    # ---- rebuilding ------------------------------------------------------------------------------

    async def delete_other_epochs(self, keep: int) -> int:
        """Delete every tenant's rollups and dedup sets of epochs other than `keep`."""
        deleted = 0
        batch: list[bytes] = []
        async for key in self.redis.scan_iter(match="inferbus:{t:*}:usage:*", count=2000):
            name = _text(key)
            epoch = name.split("}:usage:", 1)[1].split(":", 1)[0]
            if epoch != str(keep):
                batch.append(key)
            if len(batch) >= 1000:
                deleted += await self.redis.unlink(*batch)
                batch.clear()
        if batch:
            deleted += await self.redis.unlink(*batch)
        return deleted
