"""NATS and Redis restarts: the services reconnect by themselves and serve again."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import openai
import pytest

from .conftest import MODEL, Platform, running_platform
from .waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("restart"), workers=1, time_scale=0.1) as running:
        yield running


def restart(platform: Platform, name: str) -> None:
    process = platform.stack.get(name)
    process.signal(signal.SIGKILL)  # a no-op if an earlier test already killed it
    assert process.wait(5)
    process.start()  # same port, same data directory
    wait_for(process.ready, 15, what=f"{name} back")


def serves_within(platform: Platform, seconds: float) -> float:
    """Seconds until a request succeeds again (retrying as a client would)."""
    client = platform.client(timeout=5)
    started = time.monotonic()
    while True:
        try:
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert reply.usage and reply.usage.completion_tokens == 3
            return time.monotonic() - started
        except (openai.APIStatusError, openai.APIConnectionError, openai.APITimeoutError):
            assert time.monotonic() - started < seconds, f"not serving {seconds} s after the restart"
            time.sleep(0.2)


def test_platform_serves_again_after_nats_restarts(small: Platform) -> None:
    serves_within(small, 5)
    restart(small, "nats")
    serves_within(small, 20)
    for _ in range(5):  # and keeps serving: every worker queue is pulled again
        serves_within(small, 2)


def test_unreachable_redis_fails_closed_with_a_503_not_a_500(small: Platform) -> None:
    serves_within(small, 5)
    redis = small.stack.get("redis")
    redis.signal(signal.SIGKILL)
    assert redis.wait(5)
    with pytest.raises(openai.InternalServerError) as raised:
        small.client(timeout=10).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert raised.value.status_code == 503
    assert raised.value.code in ("quota_unavailable", "auth_unavailable")
    assert raised.value.response.headers["retry-after"] == "1"
    assert "Traceback" not in raised.value.response.text


def test_platform_serves_again_after_redis_restarts(small: Platform) -> None:
    restart(small, "redis")
    # A key made now must work at once after the restart (Redis keeps its append-only file, and a
    # lost key would fail authentication cleanly): make one as an operator would.
    import asyncio

    from tools.commands.local_platform import demo_key

    small.api_key = asyncio.run(demo_key(small.stack.redis_url))
    serves_within(small, 10)
