"""Per-tenant admission: rate limits, concurrency and the monthly budget in one atomic Redis call.

`Admission.admit` runs one Lua script (EVALSHA) that refills the tenant's token buckets from Redis
server time, purges expired concurrency leases, checks every dimension, and only if all pass takes
one request, the prompt tokens and `max_output_tokens` from the buckets, adds a lease and adds the
estimated cost to the month's spend. Because the check and the take are one script, any number of
gateway replicas share one set of limits. `Admission.reconcile` later swaps the reservation for
the engine-reported usage, exactly once per request id.

Keys of a tenant share the hash tag `{t:<tenant>}`, so every key a script touches lives in one
Redis Cluster slot:

    inferbus:{t:<tenant>}:quota          hash: bucket level/time/capacity per dimension,
                                         spend:<YYYY-MM> in micro-dollars
    inferbus:{t:<tenant>}:leases         sorted set: request id -> lease expiry (µs, Redis time)
    inferbus:{t:<tenant>}:res:<request>  hash: what admit reserved (tokens, micro-dollars, month)
    inferbus:{t:<tenant>}:done:<request> reconcile's idempotency mark

Works on Redis 6.2+ (plain EVAL scripts, effects replication, no functions).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from inferbus.runtime import logs
from inferbus.runtime.redis_conn import rerun_unloaded
from inferbus.stores.tenants import TenantLimits  # noqa: F401  (re-exported: callers pass a tenant's limits)

log = logs.get(__name__)

Reason = Literal["ok", "requests", "input_tokens", "output_tokens", "concurrency", "budget"]

RECONCILE_MARK_TTL_S = 7 * 24 * 3600
# A reservation outlives its lease by an hour so that a late reconcile (usage replayed from the
# USAGE stream after a gateway restart) still finds what was reserved.
RESERVATION_GRACE_S = 3600
# A script missing even after its reload means the server changed between the two (a failover
# under way): as transient as a lost connection.
_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, NoScriptError)


class _PassBatcher:
    """Redis calls share round trips: sent at once when none is in flight, else batched.

    Like Nagle's algorithm without the timer: at low load every call goes straight out, from the
    caller's own task; under load, calls made while a pipeline is on the wire leave together as
    the next one. Each
    redis-py call costs the gateway ~0.1 ms of CPU, so sharing round trips keeps admission off
    the CPU budget without adding a wait when the gateway is idle.

    With at most one round trip in flight, one connection of its own is enough, and the batcher
    talks to it directly (pack, send, read the replies) instead of through redis-py's client and
    pipeline objects, whose pool bookkeeping, instrumentation hooks and per-command callbacks cost
    ~2× the CPU of the round trip itself (measured with redis-py 8.1: 150-175 CPU-µs for one
    EVALSHA through a pipeline, 80-100 on the connection). The connection is the pool's kind (TLS,
    password, a Sentinel-managed primary: it asks the sentinels again on every reconnect) and keeps
    the client's retry policy.
    """

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self._connection: Any = None  # made on first use: the pool's kind, with its settings
        self._pending: list[tuple[tuple[Any, ...], asyncio.Future[Any], Any]] = []
        self._in_flight = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def call(self, *command: Any, script: Any = None) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self._in_flight:
            self._pending.append((command, future, script))
            return await future
        # Idle: run the round trip in the caller's own task. A separate task would cost the
        # request two more event-loop passes, each waiting behind whatever else the loop is doing.
        self._in_flight = True
        try:
            await self._execute([(command, future, script)])
        finally:
            self._in_flight = False
            if self._pending:
                self._send()
        return future.result()

    async def aclose(self) -> None:
        if self._connection is not None:
            await self._connection.disconnect()

    async def evalsha(self, script: Any, keys: list[str], args: Sequence[Any]) -> Any:
        return await self.call("EVALSHA", script.sha, len(keys), *keys, *args, script=script)

    def _send(self) -> None:
        batch, self._pending = self._pending, []
        self._in_flight = True
        task = asyncio.ensure_future(self._execute(batch))
        self._tasks.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._in_flight = False
        if self._pending:
            self._send()

    async def _execute(self, batch: list[tuple[tuple[Any, ...], asyncio.Future[Any], Any]]) -> None:
        commands = [command for command, _, _ in batch]
        try:
            if self._connection is None:
                self._connection = self.redis.connection_pool.make_connection()
            connection = self._connection
            # Nothing is owed to this connection between round trips, so anything readable is the
            # server's close (a Redis restart, an idle timeout): reconnect instead of failing a
            # request on it. (redis-py 8's pool skips this check when maintenance notifications
            # are on "auto", its default.)
            if connection.is_connected:
                try:
                    stale = await connection.can_read()
                except RedisConnectionError:  # the socket failed: redis-py has closed it already
                    stale = True
                if stale:
                    await connection.disconnect()
            results = await connection.retry.call_with_retry(
                lambda: _round_trip(connection, commands), lambda _: connection.disconnect())
        except BaseException as error:
            for _, future, _ in batch:
                if not future.done():
                    future.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return
        for (command, future, script), result in zip(batch, results):
            if isinstance(result, NoScriptError) and script is not None:
                # The server lost its script cache (a restart, a failover to a replica that never
                # ran it): load it and run this call again, on this connection, so that the load
                # reaches the server that runs the call.
                try:
                    result = (await _round_trip(connection, [("SCRIPT", "LOAD", script.script), command]))[1]
                except Exception as error:
                    result = error
            if future.done():
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)


async def _round_trip(connection: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Send `commands` in one write and read every reply, an error reply included (as its
    exception): the connection stays in step with the server whatever a command answers."""
    await connection.send_packed_command(connection.pack_commands(commands))
    replies: list[Any] = []
    for _ in commands:
        try:
            replies.append(await connection.read_response())
        except ResponseError as error:
            replies.append(error)
    return replies


class Decision(msgspec.Struct):
    admitted: bool
    reason: Reason
    retry_after_s: float  # 0 when admitted; for "budget", seconds until the next UTC month
    limits: dict[str, int]  # per limited dimension: requests, input_tokens, output_tokens, tokens, concurrency
    remaining: dict[str, int]
    reset_s: dict[str, float]  # seconds until that bucket is full again
    # False when waiting cannot help: the budget is spent, or the request alone exceeds a bucket's
    # capacity (e.g. a prompt larger than the tenant's input tokens per minute).
    retryable: bool = True

    def headers(self) -> dict[str, str]:
        return ratelimit_headers(self)


class AdmissionUnavailable(Exception):
    """Redis cannot be reached and the policy is to fail closed."""


def openai_duration(seconds: float) -> str:
    """A duration in OpenAI's `x-ratelimit-reset-*` format (Go's time.Duration style).

    Rounded up to whole milliseconds so a client never retries too early:
    0 -> "0s", 0.12 -> "120ms", 1 -> "1s", 8.64 -> "8.64s", 360 -> "6m0s", 3723.5 -> "1h2m3.5s".
    """
    ms = max(0, math.ceil(round(seconds * 1000, 6)))  # round() first: 0.12 * 1000 is 120.00000000000001
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, frac = divmod(rest, 1000)
    second = f"{whole}.{frac:03d}".rstrip("0") if frac else str(whole)
    if hours:
        return f"{hours}h{minutes}m{second}s"
    if minutes:
        return f"{minutes}m{second}s"
    return f"{second}s"


def ratelimit_headers(decision: Decision) -> dict[str, str]:
    """OpenAI's rate-limit headers for `decision` (input + output token buckets count as "tokens")."""
    headers: dict[str, str] = {}
    for dimension in ("requests", "tokens"):
        if dimension in decision.limits:
            headers[f"x-ratelimit-limit-{dimension}"] = str(decision.limits[dimension])
            headers[f"x-ratelimit-remaining-{dimension}"] = str(decision.remaining.get(dimension, 0))
            headers[f"x-ratelimit-reset-{dimension}"] = openai_duration(decision.reset_s.get(dimension, 0.0))
    if not decision.admitted:
        headers["retry-after"] = str(max(1, math.ceil(decision.retry_after_s)))
        headers["retry-after-ms"] = str(max(1, math.ceil(decision.retry_after_s * 1000)))
        if not decision.retryable:
            headers["x-should-retry"] = "false"
    return headers


def tenant_prefix(tenant: str) -> str:
    return f"inferbus:{{t:{tenant}}}:"


def _micro(usd: float) -> int:
    return round(usd * 1_000_000)


# Shared by every script: Redis time in µs and the UTC calendar month of a Unix time, computed
# with Howard Hinnant's civil-from-days algorithm (Lua in Redis has no os.date).
_PRELUDE = """
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function civil_from_days(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

-- 'YYYY-MM' of a Unix time in seconds, and the seconds from it to the start of the next month.
local function month_of(seconds)
  local y, m = civil_from_days(math.floor(seconds / 86400))
  local ny, nm = y, m + 1
  if nm == 13 then ny, nm = y + 1, 1 end
  return string.format('%04d-%02d', y, m), days_from_civil(ny, nm, 1) * 86400 - seconds
end

-- A bucket's level at `now`: starts full, refills at cap per minute, never above cap.
local function refill(level, at, cap, now)
  if not level then return cap end
  return math.min(cap, tonumber(level) + (now - tonumber(at)) * cap / 60000000)
end

-- Numbers passed to redis.call: Redis 6.2 converts them with %.14g, which loses µs timestamps.
local function num(x)
  return string.format('%.17g', x)
end
"""

# KEYS: quota, leases, reservation
# ARGV: request_id, lease_ttl_us, reservation_ttl_s, input_tokens, output_tokens, cost_micro,
#       rpm, input_tpm, output_tpm, max_concurrent, budget_micro  (-1 = unlimited)
_ADMIT = _PRELUDE + """
local quota, leases, reservation = KEYS[1], KEYS[2], KEYS[3]
local rid = ARGV[1]
local lease_ttl, reservation_ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
local cost = tonumber(ARGV[6])
local max_concurrent, budget = tonumber(ARGV[10]), tonumber(ARGV[11])
local now = now_us()
local month, to_next_month = month_of(now / 1000000)
local spend_field = 'spend:' .. month

local buckets = {
  {name = 'requests', field = 'req', need = 1, cap = tonumber(ARGV[7])},
  {name = 'input_tokens', field = 'in', need = tonumber(ARGV[4]), cap = tonumber(ARGV[8])},
  {name = 'output_tokens', field = 'out', need = tonumber(ARGV[5]), cap = tonumber(ARGV[9])},
}
local state = redis.call('HMGET', quota, 'req', 'req:t', 'in', 'in:t', 'out', 'out:t', spend_field)
local spend = tonumber(state[7]) or 0

redis.call('ZREMRANGEBYSCORE', leases, '-inf', num(now))
local in_flight = redis.call('ZCARD', leases)

local reason, wait, retryable = 'ok', 0, true
local function refuse(dimension, seconds, can_retry)
  -- Report the refusal a client must wait longest for: retrying sooner would fail again.
  if reason == 'ok' or (retryable and not can_retry) or (retryable == can_retry and seconds > wait) then
    reason, wait, retryable = dimension, seconds, can_retry
  end
end

if budget >= 0 and spend + cost > budget then
  refuse('budget', to_next_month, false)
end
if max_concurrent >= 0 and in_flight >= max_concurrent then
  local wait_s = 1
  local first = redis.call('ZRANGE', leases, 0, 0, 'WITHSCORES')
  if first[2] then wait_s = math.min(1, (tonumber(first[2]) - now) / 1000000) end
  refuse('concurrency', wait_s, max_concurrent > 0)
end
for i, b in ipairs(buckets) do
  if b.cap >= 0 then
    b.level = refill(state[2 * i - 1], state[2 * i], b.cap, now)
    if b.need > b.cap then
      refuse(b.name, 60, false)
    elseif b.need > b.level then
      refuse(b.name, (b.need - b.level) * 60 / b.cap, true)
    end
  end
end

local admitted = reason == 'ok'
local limits, remaining, reset = {}, {}, {}
for i, b in ipairs(buckets) do
  if b.cap >= 0 then
    if admitted then
      b.level = b.level - b.need
      redis.call('HSET', quota, b.field, num(b.level), b.field .. ':t', num(now), b.field .. ':c', b.cap)
      redis.call('HSET', reservation, b.field, b.need)
    end
    limits[b.name] = b.cap
    remaining[b.name] = math.max(0, math.floor(b.level))
    reset[b.name] = b.cap > 0 and (b.cap - b.level) * 60 / b.cap or 0
  end
end
-- "tokens" is input and output together, as OpenAI reports it.
for i = 2, 3 do
  local b = buckets[i]
  if b.cap >= 0 then
    limits.tokens = (limits.tokens or 0) + b.cap
    remaining.tokens = (remaining.tokens or 0) + remaining[b.name]
    reset.tokens = math.max(reset.tokens or 0, reset[b.name])
  end
end
if max_concurrent >= 0 then
  limits.concurrency = max_concurrent
  remaining.concurrency = math.max(0, max_concurrent - in_flight - (admitted and 1 or 0))
end

if admitted then
  redis.call('HINCRBY', quota, spend_field, num(cost))
  redis.call('ZADD', leases, num(now + lease_ttl), rid)
  redis.call('PEXPIRE', leases, math.ceil(lease_ttl / 1000) + 1000)
  redis.call('HSET', reservation, 'cost', num(cost), 'month', month)
  redis.call('EXPIRE', reservation, reservation_ttl)
end
return cjson.encode({admitted = admitted, reason = reason, retry_after_s = wait, retryable = retryable,
                     limits = limits, remaining = remaining, reset_s = reset})
"""

# KEYS: quota, leases, reservation, done-mark
# ARGV: request_id, input_tokens, output_tokens, cost_micro, mark_ttl_s
_RECONCILE = _PRELUDE + """
local quota, leases, reservation, mark = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if not redis.call('SET', mark, '1', 'NX', 'EX', ARGV[5]) then
  return 0
end
local actual = {['in'] = tonumber(ARGV[2]), out = tonumber(ARGV[3])}
local cost = tonumber(ARGV[4])
local now = now_us()
local reserved = redis.call('HMGET', reservation, 'in', 'out', 'cost', 'month')
if reserved[3] then
  -- Give back what was reserved but not used; take what was used beyond it (the level may go
  -- negative, which delays the tenant's next requests by exactly that overrun).
  for i, field in ipairs({'in', 'out'}) do
    if reserved[i] then
      local state = redis.call('HMGET', quota, field, field .. ':t', field .. ':c')
      if state[3] then
        local cap = tonumber(state[3])
        local level = refill(state[1], state[2], cap, now)
        level = math.min(cap, level + tonumber(reserved[i]) - actual[field])
        redis.call('HSET', quota, field, num(level), field .. ':t', num(now))
      end
    end
  end
  -- The actual cost replaces the estimate in the month the request was admitted against.
  redis.call('HINCRBY', quota, 'spend:' .. reserved[4], num(cost - tonumber(reserved[3])))
  redis.call('DEL', reservation)
else
  local month = month_of(now / 1000000)
  redis.call('HINCRBY', quota, 'spend:' .. month, num(cost))
end
redis.call('ZREM', leases, ARGV[1])
redis.call('ZREMRANGEBYSCORE', leases, '-inf', num(now))
return 1
"""

# KEYS: quota
_SPEND = _PRELUDE + """
local month = month_of(now_us() / 1000000)
return tonumber(redis.call('HGET', KEYS[1], 'spend:' .. month)) or 0
"""


class Admission:
    """The gateway's admission check: `admit` before dispatching, `reconcile` when usage is known."""

    def __init__(self, redis: aioredis.Redis, *, on_redis_error: Literal["closed", "open"] = "closed",
                 lease_ttl_s: float = 900.0) -> None:
        if on_redis_error not in ("closed", "open"):
            raise ValueError(f"on_redis_error must be 'closed' or 'open', not {on_redis_error!r}")
        if lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be positive")
        self.redis = redis
        self.on_redis_error = on_redis_error
        self.lease_ttl_s = lease_ttl_s
        # register_script sends EVALSHA and reloads the script after a Redis restart (NOSCRIPT).
        self._admit = redis.register_script(_ADMIT)
        self._reconcile = redis.register_script(_RECONCILE)
        self._spend = redis.register_script(_SPEND)
        self._batch = _PassBatcher(redis)

    async def aclose(self) -> None:
        """Close the connection admit and release use (the client's own pool is the caller's)."""
        await self._batch.aclose()

    async def admit(self, tenant: str, limits: TenantLimits, request_id: str, input_tokens: int,
                    max_output_tokens: int, estimated_cost_usd: float) -> Decision:
        if input_tokens < 0 or max_output_tokens < 0 or estimated_cost_usd < 0:
            raise ValueError("token counts and cost must not be negative")
        prefix = tenant_prefix(tenant)
        budget = limits.monthly_budget_usd
        args = (
            request_id, round(self.lease_ttl_s * 1_000_000), math.ceil(self.lease_ttl_s) + RESERVATION_GRACE_S,
            input_tokens, max_output_tokens, _micro(estimated_cost_usd),
            _limit(limits.requests_per_minute), _limit(limits.input_tokens_per_minute),
            _limit(limits.output_tokens_per_minute), _limit(limits.max_concurrent),
            -1 if budget is None else _micro(budget),
        )
        try:
            raw = await self._batch.evalsha(
                self._admit, [prefix + "quota", prefix + "leases", prefix + "res:" + request_id], args
            )
        except _UNAVAILABLE as error:
            if self.on_redis_error == "closed":
                raise AdmissionUnavailable(f"quota store unreachable: {error}") from error
            log.warning("admission_open_without_redis", tenant=tenant, error=repr(error))
            return Decision(admitted=True, reason="ok", retry_after_s=0.0, limits={}, remaining={}, reset_s={})
        return msgspec.json.decode(raw, type=Decision)

    async def reconcile(self, tenant: str, request_id: str, input_tokens: int, output_tokens: int,
                        cost_usd: float) -> bool:
        """Replace the reservation with actual usage; True the first time for a request id, then False.

        Raises AdmissionUnavailable when Redis cannot be reached: the caller retries later, and the
        idempotency mark makes the retry safe.
        """
        prefix = tenant_prefix(tenant)
        keys = [prefix + "quota", prefix + "leases", prefix + "res:" + request_id, prefix + "done:" + request_id]
        try:
            done = await self._reconcile(keys=keys, args=(request_id, input_tokens, output_tokens,
                                                          _micro(cost_usd), RECONCILE_MARK_TTL_S))
        except _UNAVAILABLE as error:
            raise AdmissionUnavailable(f"quota store unreachable: {error}") from error
        return bool(done)

    async def release(self, tenant: str, request_id: str) -> None:
        """Free a request's concurrency lease now; tokens and cost reconcile later from the ledger.

        The gateway calls this the moment a request ends, so a client that sends its next request
        straight away is not refused while the usage event is still on its way. Idempotent.
        """
        try:
            await self._batch.call("ZREM", tenant_prefix(tenant) + "leases", request_id)
        except _UNAVAILABLE as error:
            raise AdmissionUnavailable(f"quota store unreachable: {error}") from error

    async def reconcile_many(self, usages: Sequence[tuple[str, str, int, int, float]]) -> list[bool]:
        """`reconcile` for many (tenant, request_id, input, output, cost) at once: one round trip.

        Raw EVALSHA in the pipeline: a registered script run through a pipeline costs another
        round trip (`SCRIPT EXISTS`) on every call; a lost script cache is handled here instead."""
        calls = []
        for tenant, request_id, input_tokens, output_tokens, cost_usd in usages:
            prefix = tenant_prefix(tenant)
            calls.append(("EVALSHA", self._reconcile.sha, 4, prefix + "quota", prefix + "leases",
                          prefix + "res:" + request_id, prefix + "done:" + request_id,
                          request_id, input_tokens, output_tokens, _micro(cost_usd), RECONCILE_MARK_TTL_S))
        try:
            results = await rerun_unloaded(self.redis, self._reconcile.script, calls, await self._pipelined(calls))
        except _UNAVAILABLE as error:
            raise AdmissionUnavailable(f"quota store unreachable: {error}") from error
        for result in results:
            if isinstance(result, Exception):
                raise result
        return [bool(done) for done in results]

    async def _pipelined(self, calls: Sequence[tuple[Any, ...]]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        for call in calls:
            pipe.execute_command(*call)
        return list(await pipe.execute(raise_on_error=False))

    async def spend_this_month(self, tenant: str) -> float:
        """The tenant's spend in the current UTC month (Redis time), reservations included, in USD."""
        try:
            micro = await self._spend(keys=[tenant_prefix(tenant) + "quota"])
        except _UNAVAILABLE as error:
            raise AdmissionUnavailable(f"quota store unreachable: {error}") from error
        return int(micro) / 1_000_000


def _limit(value: int | None) -> int:
    if value is None:
        return -1
    if value < 0:
        raise ValueError(f"limits must not be negative: {value}")
    return value


# ---- reading a tenant's quota state (the console's "how close to each limit") -----------------

class QuotaUse(msgspec.Struct, frozen=True):
    """How much of one limit is in use now: `used` of `limit` (a token or request bucket's used
    part refills at `limit` per minute; concurrency counts live leases; budget the month's spend)."""

    name: Literal["requests_per_minute", "input_tokens_per_minute", "output_tokens_per_minute", "max_concurrent",
                  "monthly_budget_usd"]
    limit: float
    used: float

    @property
    def share(self) -> float:
        return self.used / self.limit if self.limit > 0 else (1.0 if self.used > 0 else 0.0)


def utc_month(seconds: float) -> str:
    """'YYYY-MM' of a unix time, as the scripts' `month_of` computes it."""
    import datetime as dt

    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m")


def quota_uses(limits: TenantLimits, state: Sequence[Any], in_flight: int, spend_micro: int,
               now_us: int) -> list[QuotaUse]:
    """Pure: every limit the tenant has, with its use now, from the quota hash's fields
    (req, req:t, in, in:t, out, out:t: level and time of each bucket, as `_ADMIT` writes them)."""
    found: list[QuotaUse] = []
    buckets = (("requests_per_minute", limits.requests_per_minute, 0),
               ("input_tokens_per_minute", limits.input_tokens_per_minute, 2),
               ("output_tokens_per_minute", limits.output_tokens_per_minute, 4))
    for name, cap, at in buckets:
        if cap is None:
            continue
        level_raw, time_raw = state[at], state[at + 1]
        if level_raw is None or time_raw is None:
            level = float(cap)  # never used: full
        else:  # the scripts' refill(): starts full, refills at cap per minute, never above cap
            level = min(float(cap), float(level_raw) + (now_us - float(time_raw)) * cap / 60_000_000)
        found.append(QuotaUse(name=name, limit=float(cap), used=max(0.0, cap - level)))  # type: ignore[arg-type]
    if limits.max_concurrent is not None:
        found.append(QuotaUse(name="max_concurrent", limit=float(limits.max_concurrent), used=float(in_flight)))
    if limits.monthly_budget_usd is not None:
        found.append(QuotaUse(name="monthly_budget_usd", limit=limits.monthly_budget_usd, used=spend_micro / 1_000_000))
    return found


async def read_quota(redis: aioredis.Redis, tenant: str, limits: TenantLimits) -> list[QuotaUse]:
    """The tenant's use of each of its limits now (Redis time), without changing anything."""
    prefix = tenant_prefix(tenant)
    seconds, micros = await redis.time()
    now_us = int(seconds) * 1_000_000 + int(micros)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hmget(prefix + "quota", ["req", "req:t", "in", "in:t", "out", "out:t", f"spend:{utc_month(seconds)}"])
        pipe.zcount(prefix + "leases", f"({now_us}", "+inf")
        state, in_flight = await pipe.execute()
    return quota_uses(limits, state[:6], int(in_flight), int(float(state[6] or 0)), now_us)
