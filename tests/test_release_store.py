"""Releases and rollouts in the `models` bucket of a real nats-server, and the commands on them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from click.testing import CliRunner

from inferbus.releases import canary, record, store
from proto import messages as m
from tools.commands.main import main

from .nats_server import NatsServer

pytestmark = pytest.mark.slow

COMMIT = "0123456789abcdef0123456789abcdef01234567"
IMAGE = "lmsysorg/sglang@sha256:" + "ab" * 32


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    running = NatsServer(tmp_path / "nats")
    running.start()
    yield running
    running.stop()


def release(directory: Path, weights: bytes) -> m.Release:
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(weights)
    (directory / "chat_template.jinja").write_text("{{ messages }}")
    return record.build_release("llama", directory, repo="org/llama", revision=COMMIT, engine_image=IMAGE)


def test_records_are_immutable_and_rollouts_compare_and_set(server: NatsServer, tmp_path: Path) -> None:
    first, second = release(tmp_path / "a", b"one"), release(tmp_path / "b", b"two")

    async def scenario() -> None:
        nc = await nats.connect(server.url)
        kv = await store.bucket(nc.jetstream())
        assert await store.releases(kv) == []
        assert await store.put_release(kv, first) is True
        assert await store.put_release(kv, first) is False  # the same content: the same record
        await store.put_release(kv, second)
        assert (await store.resolve(kv, record.short(second.id))).id == second.id
        with pytest.raises(LookupError):
            await store.resolve(kv, "ffffffffffff")
        stable = m.Rollout(model="llama", stable=first.id, updated=1.0)
        revision = await store.put_rollout(kv, stable, 0)
        with pytest.raises(store.Conflict):
            await store.put_rollout(kv, stable, 0)  # someone created it first
        started = canary.start(first.id, second.id, "llama", 0.05, now=2.0)
        await store.put_rollout(kv, started, revision)
        with pytest.raises(store.Conflict):
            await store.put_rollout(kv, canary.rollback(started, 3.0, "late"), revision)  # a stale revision
        current, _ = await store.get_rollout(kv, "llama")
        assert current == started
        assert [r.state for r in await store.rollout_history(kv, "llama")] == ["stable", "canary"]
        await nc.close()

    asyncio.run(scenario())


def test_an_undecodable_release_or_rollout_is_skipped_and_a_write_replaces_it(
    server: NatsServer, tmp_path: Path
) -> None:
    from proto import subjects

    good = release(tmp_path / "a", b"one")

    async def scenario() -> None:
        nc = await nats.connect(server.url)
        kv = await store.bucket(nc.jetstream())
        await store.put_release(kv, good)
        await kv.put(subjects.release_key("f" * 64), b"junk")
        await kv.put(subjects.rollout_key("llama"), b"junk")
        assert [r.id for r in await store.releases(kv)] == [good.id]
        assert await store.get_release(kv, "f" * 64) is None
        current, revision = await store.get_rollout(kv, "llama")
        assert current is None and revision > 0
        assert await store.rollout_history(kv, "llama") == []
        stable = m.Rollout(model="llama", stable=good.id, updated=1.0)
        await store.put_rollout(kv, stable, revision)  # the junk's revision: replaced
        assert (await store.get_rollout(kv, "llama"))[0] == stable
        await nc.close()

    asyncio.run(scenario())


def test_release_commands(server: NatsServer, tmp_path: Path) -> None:
    runner = CliRunner()
    nats_url = ["--nats-url", server.url]
    empty = runner.invoke(main, ["release", "status", *nats_url])
    assert empty.exit_code == 0 and "No model has a release yet" in empty.stdout
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"w")
    (directory / "chat_template.jinja").write_text("{{ messages }}")
    refused = runner.invoke(
        main,
        [
            "release",
            "create",
            "--model",
            "llama",
            "--model-dir",
            str(directory),
            "--repo",
            "org/llama",
            "--revision",
            "main",
            "--engine-image",
            IMAGE,
            *nats_url,
        ],
    )
    assert refused.exit_code == 1 and "not a pinned commit" in refused.output
    ids = []
    for weights in (b"w", b"w2"):
        (directory / "model.safetensors").write_bytes(weights)
        created = runner.invoke(main, ["release", "create", "--model", "llama", "--model-dir", str(directory), "--repo",
                                       "org/llama", "--revision", COMMIT, "--engine-image", IMAGE, *nats_url])
        assert created.exit_code == 0, created.output
        ids.append(created.stdout.strip())
    no_stable = runner.invoke(main, ["release", "canary", ids[1], *nats_url])
    assert no_stable.exit_code == 1 and "no stable release" in no_stable.output
    assert runner.invoke(main, ["release", "stable", ids[0][:16], *nats_url]).exit_code == 0
    started = runner.invoke(main, ["release", "canary", ids[1], "--traffic", "5%", "--window", "2m", *nats_url])
    assert started.exit_code == 0, started.output
    assert "share 5%  steps 5% → 25% → 100%" in started.stdout
    again = runner.invoke(main, ["release", "canary", ids[1], *nats_url])
    assert again.exit_code == 1 and "has a canary running" in again.output
    assert runner.invoke(main, ["release", "rollback", "llama", "--reason", "manual", *nats_url]).exit_code == 0
    status = json.loads(runner.invoke(main, ["release", "status", "--history", "--json", *nats_url]).stdout)
    assert [state["state"] for state in status[0]] == ["stable", "canary", "rolled_back"]
    assert status[0][-1]["reason"] == "manual"
