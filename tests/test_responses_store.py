"""Stored responses in the `responses` KV bucket of a real nats-server: per tenant, durable across
a server restart, the retention period and size limit applied to the bucket."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from inferbus.bus import connection as bus
from inferbus.local.ports import free_port
from inferbus.local.servers import nats_server_binary
from proto import messages as m
from services.gateway.responses_store import ResponseStore

from .waiting import await_for

pytestmark = pytest.mark.slow


class Nats:
    def __init__(self, data: Path) -> None:
        self.port = free_port()
        self.data = data
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js",
                                         "-sd", str(self.data)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "nats-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        assert self.process is not None
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[Nats]:
    server = Nats(tmp_path)
    server.start()
    yield server
    server.stop()


def record(tenant: str, response_id: str, size: int = 10) -> m.StoredResponse:
    return m.StoredResponse(id=response_id, tenant=tenant, created_at=1, response=b'{"id":"%s"}' % response_id.encode(),
                            input_items=b"[" + b" " * size + b"]")


async def test_stored_per_tenant_and_durable_across_a_server_restart(nats_server: Nats) -> None:
    nc = await bus.connect(nats_server.url, name="test")
    store = await ResponseStore.open(nc.jetstream(), retention_s=3600, max_bytes=10_000)
    await store.put(record("acme", "resp_1"))
    assert (await store.get("acme", "resp_1")).response == b'{"id":"resp_1"}'
    assert await store.get("other", "resp_1") is None
    assert not await store.delete("other", "resp_1")
    for odd in ("resp_1.x", "resp_1 ", "*", ">", "r" * 5000, ""):  # never a key, never a subject sent
        assert await store.get("acme", odd) is None
    await nc.close()

    nats_server.stop()
    nats_server.start()
    nc = await bus.connect(nats_server.url, name="test")
    store = await ResponseStore.open(nc.jetstream(), retention_s=3600, max_bytes=10_000)
    assert (await store.get("acme", "resp_1")).tenant == "acme"
    assert await store.delete("acme", "resp_1")
    assert await store.get("acme", "resp_1") is None
    assert not await store.delete("acme", "resp_1")
    await nc.close()


async def test_retention_and_size_limit_are_the_buckets_and_ops_makes_them_follow_the_settings(
    nats_server: Nats,
) -> None:
    nc = await bus.connect(nats_server.url, name="test")
    js = nc.jetstream()
    store = await ResponseStore.open(js, retention_s=3600, max_bytes=2000)
    config = (await js.stream_info("KV_responses")).config
    assert config.max_age == 3600 and config.max_msg_size is not None and config.max_msg_size >= 2000
    assert store.fits(b"x" * 1000, b"y" * 1000) and not store.fits(b"x" * 1000, b"y" * 1001)
    # A new retention setting, an existing bucket: reported, and applied by an operator's reopen only.
    assert (await ResponseStore.open(js, retention_s=1, max_bytes=2000)).drift
    assert REGISTRY.get_sample_value("inferbus_stream_config_drift", {"stream": "KV_responses"}) == 1
    assert (await js.stream_info("KV_responses")).config.max_age == 3600
    # A larger size limit in the settings than the bucket's: stored records follow the bucket's.
    assert (await ResponseStore.open(js, retention_s=3600, max_bytes=4000)).fits(b"x" * 1000, b"y" * 1000)
    assert not (await ResponseStore.open(js, retention_s=3600, max_bytes=4000)).fits(b"x" * 1000, b"y" * 1001)
    assert (await ResponseStore.open(js, retention_s=1, max_bytes=2000, update=True)).drift == []
    assert REGISTRY.get_sample_value("inferbus_stream_config_drift", {"stream": "KV_responses"}) == 0
    assert (await js.stream_info("KV_responses")).config.max_age == 1
    await store.put(record("acme", "resp_old"))
    async def expired() -> bool:
        return await store.get("acme", "resp_old") is None

    await await_for(expired, 10, interval=0.2, what="the server expiring the stored response")
    await nc.close()
