"""A tenant's new LoRA adapter version canaried within that adapter's own traffic, on the live
platform: split per conversation, promoted or rolled back by the gates measured per adapter
version, no client error, and nobody else's traffic touched (another tenant on the base model and
on its own adapter keeps being served exactly as before).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner

from inferbus.releases import record
from proto import messages as m
from services.sim_engine import quality
from tools.commands.main import main

from .canary_helpers import Decisions, Load, cli, decisions
from .conftest import MODEL, Platform, read_usage, running_platform

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    env = {
        # Small samples and short windows, so that a canary finishes in seconds (production: 200, 5 min).
        "INFERBUS_CANARY_MIN_SAMPLES": "40", "INFERBUS_CANARY_TICK_S": "0.5",
        # CPU contention on a shared test machine moves real step times by tens of percent.
        "INFERBUS_CANARY_LATENCY_TOLERANCE": "0.5",
    }
    with running_platform(tmp_path_factory.mktemp("adapter-canary"), workers=2, time_scale=1.0, batch=False,
                          extra_env=env) as running:
        yield running


@pytest.fixture(scope="module")
def other_key(platform: Platform) -> str:
    """A second tenant, with its own private adapter: its traffic must not notice the canary."""
    with platform.admin() as admin:
        admin.post("/tenants", json={"id": "other"}).raise_for_status()
        made = admin.post("/tenants/other/keys", json={"name": "ci"})
        made.raise_for_status()
        return made.json()["secret"]


def adapter_dir(root: Path, name: str, accuracy: float, weights: bytes) -> Path:
    target = root / name
    target.mkdir()
    (target / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (target / "adapter_model.safetensors").write_bytes(weights * 100)
    quality.write_accuracy(target, accuracy)
    return target


def register(platform: Platform, name: str, directory: Path, owner: str) -> str:
    version = record.directory_digest(directory)
    with platform.admin() as admin:
        made = admin.post("/adapters", json={"name": name, "version": version, "path": str(directory), "owner": owner})
        assert made.status_code == 201, made.text
    return version


def registration(platform: Platform, name: str) -> dict:
    with platform.admin() as admin:
        return admin.get(f"/adapters/{name}").json()


def adapter_status(platform: Platform, adapter: str, history: bool = False) -> list[dict]:
    found = json.loads(
        cli(platform, "release", "status", "--model", adapter, "--json", *(["--history"] if history else []))
    )
    return next(states for states in found if states[0].get("adapter") == adapter)


def engine_name(adapter: str, version: str) -> str:
    return m.adapter_engine_name(adapter, version)


def run_eval(platform: Platform, adapter: str, version: str, *extra: str) -> tuple[int, str, str]:
    """(exit status, the verdict on stdout, everything for a failure's message)."""
    result = CliRunner().invoke(main, ["eval", "arithmetic", "--model", adapter, "--release", record.short(version),
                                       "--url", platform.stack.gateway_url, "--api-key", platform.api_key,
                                       "--nats-url", platform.stack.nats_url, *extra])
    return result.exit_code, result.stdout, result.output


def test_a_good_adapter_version_is_promoted_within_its_tenants_traffic(platform: Platform, other_key: str,
                                                                       tmp_path: Path) -> None:
    v1 = register(platform, "acme-bot", adapter_dir(tmp_path, "acme-v1", 0.96, b"acme-v1"), owner="demo")
    v2_dir = adapter_dir(tmp_path, "acme-v2", 0.96, b"acme-v2")
    v2 = record.directory_digest(v2_dir)
    register(platform, "other-bot", adapter_dir(tmp_path, "other-v1", 0.95, b"other-v1"), owner="other")

    with Load(platform, platform.api_key, "acme-bot", 8, "acme") as acme, \
            Load(platform, other_key, MODEL, 2, "other-base") as other_base, \
            Load(platform, other_key, "other-bot", 2, "other-adapter") as other_adapter:
        time.sleep(2)
        started = cli(platform, "release", "adapter-canary", "acme-bot", "--path", str(v2_dir), "--traffic", "50%",
                      "--steps", "100%", "--window", "3s", "--eval-suite", "arithmetic")
        assert "adapter acme-bot (of " in started and "share 50%" in started
        assert registration(platform, "acme-bot")["candidate_version"] == v2
        listed = CliRunner().invoke(main, ["adapters", "list", "--url", platform.stack.gateway_url,
                                           "--admin-key", platform.admin_key])
        row = next(line for line in listed.output.splitlines() if line.startswith("acme-bot "))
        assert v1[:19] in row and v2[:19] in row, listed.output
        # 40 items × 25 repeats per version, both at 96%: a pass with probability > 0.99.
        code, verdict, output = run_eval(platform, "acme-bot", v2, "--concurrency", "6")
        assert code == 0, output
        assert verdict.startswith("PASS: suite arithmetic: candidate"), output
        deadline = time.monotonic() + 150
        while adapter_status(platform, "acme-bot")[0]["state"] == "canary" and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)  # traffic after the promotion
    assert acme.errors == [] and other_base.errors == [] and other_adapter.errors == []

    now = adapter_status(platform, "acme-bot")[0]
    assert now["state"] == "promoted" and now["stable"] == v2 and now["model"] == MODEL, now
    assert "SLO gate passed" in now["reason"] and "eval gate passed" in now["reason"]
    # The registration says what serves now: the promoted version, no candidate.
    registered = registration(platform, "acme-bot")
    assert registered["version"] == v2 and registered.get("candidate_version") is None
    history = adapter_status(platform, "acme-bot", history=True)
    assert [h["share"] for h in history if h["state"] == "canary"][0] == 0.5

    # The adapter's requests ran on both versions during the canary, only on v2 after it.
    events = read_usage(platform, "demo", set(acme.ids), timeout=20)
    assert {e.adapter for e in events} == {engine_name("acme-bot", v1), engine_name("acme-bot", v2)}
    after = [e for e in events if e.started > now["updated"] + 1.0]  # accepted after the promotion
    assert after and {e.adapter for e in after} == {engine_name("acme-bot", v2)}
    # The other tenant's traffic was never split: the base model, and its adapter's one version.
    others = read_usage(platform, "other", set(other_base.ids) | set(other_adapter.ids), timeout=20)
    assert len(others) == len(other_base.ids) + len(other_adapter.ids)
    other_version = registration(platform, "other-bot")["version"]
    assert {e.adapter for e in others} == {None, engine_name("other-bot", other_version)}


def test_an_adapter_version_that_answers_worse_is_rolled_back_by_the_eval_gate(platform: Platform,
                                                                             tmp_path: Path) -> None:
    v1 = register(platform, "acme-summarizer", adapter_dir(tmp_path, "sum-v1", 0.95, b"sum-v1"), owner="demo")
    broken_dir = adapter_dir(tmp_path, "sum-broken", 0.70, b"sum-broken")
    broken = record.directory_digest(broken_dir)

    with Load(platform, platform.api_key, "acme-summarizer", 4, "summaries") as load:
        time.sleep(1)
        cli(platform, "release", "adapter-canary", "acme-summarizer", "--path", str(broken_dir), "--traffic", "25%",
            "--steps", "100%", "--window", "60s", "--eval-suite", "arithmetic")
        with Decisions(platform, "acme-summarizer") as watch:
            code, verdict, output = run_eval(platform, "acme-summarizer", broken, "--repeats", "8")
            assert code == 1, output
            assert verdict.startswith("FAIL: suite arithmetic: candidate"), output
            seen = watch.until({"rollback"}, timeout=30)
        time.sleep(3)  # traffic after the rollback
    assert load.errors == []
    assert seen and seen[-1].action == "rollback" and "eval gate failed" in seen[-1].reason, [
        (d.action, d.reason) for d in seen]
    assert seen[-1].adapter == "acme-summarizer" and seen[-1].candidate == broken
    now = adapter_status(platform, "acme-summarizer")[0]
    assert now["state"] == "rolled_back" and now["stable"] == v1 and now.get("share", 0) == 0
    registered = registration(platform, "acme-summarizer")
    assert registered["version"] == v1 and registered.get("candidate_version") is None
    events = read_usage(platform, "demo", set(load.ids), timeout=20)
    after = [e for e in events if e.started > seen[-1].ts + 1.0]  # accepted after the rollback
    assert after and {e.adapter for e in after} == {engine_name("acme-summarizer", v1)}
    # A pin to the rolled-back version is refused now: it is no longer a registered version.
    with pytest.raises(openai.BadRequestError, match="not a registered version"):
        platform.client().chat.completions.create(
            model="acme-summarizer",
            max_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"inferbus-release": broken.removeprefix("sha256:")[:12]},
        )


def test_a_candidate_that_cannot_load_is_rolled_back_by_the_slo_gate_without_a_client_error(
        platform: Platform, tmp_path: Path) -> None:
    v1 = register(platform, "acme-router", adapter_dir(tmp_path, "router-v1", 0.95, b"router-v1"), owner="demo")
    v2 = record.directory_digest(adapter_dir(tmp_path, "router-v2", 0.95, b"router-v2"))

    with Load(platform, platform.api_key, "acme-router", 8, "routing") as load:
        time.sleep(1)
        # The new version's files are not where the workers look (a remote path that was never
        # uploaded; the simulated engine fails to load paths starting with "missing").
        cli(platform, "release", "adapter-canary", "acme-router", "--path", "missing/acme-router-v2", "--version", v2,
            "--traffic", "50%", "--steps", "100%", "--window", "60s")
        seen = decisions(platform, "acme-router", {"rollback", "promote"}, timeout=90)
        time.sleep(1)
    # The candidate's requests went on to the registered version: the clients saw none of it.
    assert load.errors == []
    assert seen and seen[-1].action == "rollback", [(d.action, d.reason) for d in seen]
    assert "SLO gate failed" in seen[-1].reason and "error rate 100.00%" in seen[-1].reason
    assert seen[-1].slo["candidate_requests"] >= 40 and seen[-1].candidate == v2
    assert adapter_status(platform, "acme-router")[0]["state"] == "rolled_back"
    events = read_usage(platform, "demo", set(load.ids), timeout=20)
    assert len(events) == len(load.ids) and {e.adapter for e in events} == {engine_name("acme-router", v1)}
    assert any(e.attempts == 2 for e in events)  # continued on the registered version
