"""A worker whose engine dies and comes back: it stops taking work and says so (the gateway is not
ready without a serving worker), probes the engine with a growing delay, and after the restart
loads its adapters again instead of failing every adapter request."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from .conftest import MODEL, Platform, running_platform
from .waiting import wait_for

pytestmark = pytest.mark.e2e

DIGEST = "sha256:" + "cd" * 32


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("restart"), workers=1, time_scale=0.1, batch=False,
                          extra_env={"INFERBUS_HEARTBEAT_INTERVAL_S": "0.3"}) as running:
        yield running


def _ready(platform: Platform) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(platform.stack.gateway_url + "/ready", timeout=2) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def _wait_ready(platform: Platform, status: int, timeout: float = 30) -> dict:
    _, body = wait_for(lambda: (answer := _ready(platform))[0] == status and answer, timeout, interval=0.1,
                       what=f"/ready answering {status}")
    return body


def _worker_log(platform: Platform) -> list[dict]:
    return [json.loads(line) for line in platform.stack.get("worker-1").log_path.read_text().splitlines()
            if line.startswith("{")]


def _failed_probes(platform: Platform) -> list[float]:
    """The delays before the next probe the worker logged, one per failed probe of its engine."""
    return [entry["retry_in_s"] for entry in _worker_log(platform) if entry.get("event") == "engine_probe_failed"]


def test_after_an_engine_restart_adapters_are_loaded_again(single: Platform) -> None:
    with single.admin() as admin:
        assert (
            admin.post("/adapters", json={"name": "helper", "version": DIGEST, "path": "s3://ok/helper"}).status_code
            == 201
        )
    wait_for(lambda: "helper" in {card.id for card in single.client().models.list().data}, 30, interval=0.1,
             what="the adapter listed")
    first = single.client(timeout=30).completions.create(model="helper", prompt="hello", max_tokens=3, temperature=0)
    assert first.choices[0].text

    engine = single.stack.get("engine-1")
    engine.signal(signal.SIGKILL)
    engine.wait(10)
    body = _wait_ready(single, 503)  # the worker noticed: no worker can serve, so the gateway is not ready
    assert "no_workers" in body["problems"]
    # Some probes fail meanwhile, each after a longer delay.
    wait_for(lambda: len(probes := _failed_probes(single)) >= 3 and probes[-1] >= 4 * probes[0], 30, interval=0.1,
             what="three failed probes of the engine, backing off")
    engine.start()  # the same port: as an engine restarted in place
    _wait_ready(single, 200, timeout=60)
    again = single.client(timeout=30).completions.create(model="helper", prompt="hello", max_tokens=3, temperature=0)
    assert again.choices[0].text == first.choices[0].text  # the same adapter, loaded again: not a 500
    base = single.client(timeout=30).completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0)
    assert base.choices[0].text

    log = _worker_log(single)
    probes = _failed_probes(single)
    assert len(probes) >= 3 and probes == sorted(probes) and probes[-1] >= 4 * probes[0]  # backing off
    back = next(i for i, entry in enumerate(log) if entry.get("event") == "engine_back")
    assert log[back].get("adapters_forgotten") == 1
    # The new engine's cache is empty: the router was told (a snapshot of nothing) before the worker said it was back.
    assert any(entry.get("event") == "cache_snapshot_sent" and entry.get("blocks") == 0 for entry in log[back - 3:back])
