"""Redis clients from one URL, for a single server or a Sentinel-managed primary.

A plain `redis://` / `rediss://` URL is redis-py's own. A Sentinel deployment is named by

    redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]

(the sentinels, the name they monitor the primary under, the database). The client asks the
sentinels where the primary is on every new connection, so after a failover (Sentinel promotes a
replica when the primary stops answering) the next command goes to the new primary. Commands that fail with a connection
error meanwhile are retried with backoff for about `FAILOVER_RETRY_S` (redis-py's `Retry`), each retry asking the
sentinels again: a failover (the sentinels' down-after time plus an election) costs a client a
delay, not an error. The password is
the data nodes' and the sentinels' (a deployment gives both the same `requirepass`), see
https://redis.io/docs/latest/operate/oss_and_stack/management/sentinel/.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.exceptions import NoScriptError
from redis.sentinel import Sentinel
from redis.typing import ScriptTextT

SENTINEL_SCHEME = "redis+sentinel"
FAILOVER_RETRY_S = 4.0  # the retries' total backoff: 0.05 s doubling to 0.5 s, 10 tries


def _failover_retry(asyncio_client: bool) -> dict[str, Any]:
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError, TimeoutError

    if asyncio_client:
        from redis.asyncio.retry import Retry as AsyncRetry

        retry: Any = AsyncRetry(ExponentialBackoff(cap=0.5, base=0.05), 10)
    else:
        from redis.retry import Retry

        retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), 10)
    return {"retry": retry, "retry_on_error": [ConnectionError, TimeoutError]}


@dataclass(frozen=True)
class SentinelURL:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    password: str | None = None


def parse_sentinel_url(url: str) -> SentinelURL | None:
    """The parts of a `redis+sentinel://` URL, or None for any other URL."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        return None
    hosts_part = parts.netloc.rsplit("@", 1)[-1]
    password = unquote(parts.password) if parts.password else None
    sentinels = []
    for host_port in hosts_part.split(","):
        host, _, port = host_port.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"sentinel address {host_port!r} in {redact(url)} is not HOST:PORT")
        sentinels.append((host, int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ValueError(f"{redact(url)} names no service: redis+sentinel://HOSTS/SERVICE[/DB]")
    db = int(path[1]) if len(path) > 1 else 0
    return SentinelURL(tuple(sentinels), path[0], db, password)


def redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)


def _sentinel_kwargs(parsed: SentinelURL, kwargs: dict[str, Any]) -> dict[str, Any]:
    timeouts = {k: v for k, v in kwargs.items() if k in ("socket_timeout", "socket_connect_timeout")}
    return {**timeouts, **({"password": parsed.password} if parsed.password else {})}


def async_client(url: str, *, max_connections: int | None = None, **kwargs: Any) -> aioredis.Redis:
    """An asyncio client for `url`; with `max_connections`, a blocking pool of that size (a burst
    waits for a connection up to `timeout` seconds instead of failing at the cap)."""
    parsed = parse_sentinel_url(url)
    if parsed is None:
        if max_connections is None:
            return aioredis.from_url(url, **kwargs)
        pool_options = {k: kwargs.pop(k) for k in ("timeout",) if k in kwargs}
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, **pool_options, **kwargs)
        return aioredis.Redis(connection_pool=pool)
    kwargs.pop("timeout", None)  # Sentinel pools are not blocking pools
    sentinel = AsyncSentinel(list(parsed.sentinels), sentinel_kwargs=_sentinel_kwargs(parsed, kwargs))
    options: dict[str, Any] = {**_failover_retry(True), **kwargs, "db": parsed.db}
    if parsed.password:
        options["password"] = parsed.password
    if max_connections is not None:
        options["max_connections"] = max_connections
    return sentinel.master_for(parsed.service, **options)


def sync_client(url: str, **kwargs: Any) -> redis.Redis:
    """A blocking client for `url` (the launcher's readiness checks, the CLI)."""
    parsed = parse_sentinel_url(url)
    if parsed is None:
        return redis.Redis.from_url(url, **kwargs)
    sentinel = Sentinel(list(parsed.sentinels), sentinel_kwargs=_sentinel_kwargs(parsed, kwargs))
    options: dict[str, Any] = {**kwargs, "db": parsed.db}
    if parsed.password:
        options["password"] = parsed.password
    return sentinel.master_for(parsed.service, **options)


def sentinel_url(sentinels: list[tuple[str, int]], service: str, password: str = "", db: int = 0) -> str:
    auth = f":{password}@" if password else ""
    hosts = ",".join(f"{host}:{port}" for host, port in sentinels)
    return f"{SENTINEL_SCHEME}://{auth}{hosts}/{service}/{db}"


async def rerun_unloaded(client: aioredis.Redis, script: ScriptTextT, calls: Sequence[tuple[Any, ...]],
                         results: list[Any]) -> list[Any]:
    """`results` of a pipeline of `calls` (raw EVALSHAs of `script`, errors as values), with the
    calls that found no script run again behind a SCRIPT LOAD in one pipeline. The server loses its
    script cache on a restart, and a replica promoted by a failover may never have run the script;
    one pipeline is one connection, so the load reaches the server that runs the calls (loading
    through any pooled connection could reach the old primary instead)."""
    missing = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
    if not missing:
        return results
    pipe = client.pipeline(transaction=False)
    pipe.script_load(script)
    for i in missing:
        pipe.execute_command(*calls[i])
    again = (await pipe.execute(raise_on_error=False))[1:]
    for i, result in zip(missing, again, strict=True):
        results[i] = result
    return results
