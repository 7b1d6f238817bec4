"""The whole platform with an identity per service from the auth callout (as
deploy/k8s/per-pod-identities runs it, with tokens of its own instead of ServiceAccount tokens):
every service connects with its token, gets its role's permissions scoped to its own name, and
the platform serves; a client with a password or a token it was not given is refused."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import pytest

from proto import messages as m
from proto import subjects

from .conftest import MODEL, Platform, running_platform

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def callout_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("callout"), workers=2, time_scale=0.1, callout=True) as running:
        yield running


def test_the_platform_serves_with_per_service_identities(callout_platform: Platform) -> None:
    client = callout_platform.client()
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a story"}],
                                            max_tokens=20, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20

    async def probe() -> bytes:
        # A worker answers liveness probes (allow_responses in its user JWT).
        nc = await nats.connect(callout_platform.stack.nats_url)
        try:
            probe = m.encode(m.LivenessProbe(worker_id="worker-1"))
            return (await nc.request(subjects.liveness_subject("worker-1"), probe, timeout=5)).data
        finally:
            await nc.close()

    assert msgspec.msgpack.decode(asyncio.run(probe()), type=m.LivenessReply).worker_id == "worker-1"
    stack = callout_platform.stack
    logs = {p.name: p.log_path.read_text(errors="replace") for p in stack.processes if p.name != "redis"}
    violations = [line for text in logs.values() for line in text.splitlines() if "Permissions Violation" in line]
    assert violations == [], violations[:5]
    assert "callout_bad_request" not in logs["auth-callout"]
    errors = [line for text in logs.values() for line in text.splitlines() if "Authorization Violation" in line]
    assert errors == [], errors[:5]


def test_passwords_and_tokens_of_others_are_refused(callout_platform: Platform) -> None:
    stack = callout_platform.stack
    assert stack.identities is not None
    gateway = stack.identities["gateway"]
    url = stack.nats_server_url

    async def refused(**options: object) -> bool:
        try:
            nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5,
                                    **options)  # type: ignore[arg-type]
        except Exception:
            return True
        await nc.close()
        return False

    token = Path(stack.config.state_dir / "tokens" / "gateway").read_text().strip()
    assert asyncio.run(refused(user=gateway.user, password=gateway.password))  # static users are gone
    assert asyncio.run(refused(token="not-a-token"))
    assert not asyncio.run(refused(token=token, inbox_prefix="_INBOX.gateway"))  # the control: its own token works


def test_every_platform_command_works_with_callout_identities(callout_platform: Platform, tmp_path: Path) -> None:
    from .test_cli_local_platform import every_platform_command

    every_platform_command(callout_platform, tmp_path / "exports")
