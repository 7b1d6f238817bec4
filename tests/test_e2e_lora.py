"""Many LoRA adapters on a real platform: bulk registration (admin API and CLI), tenant access by
the `adapters` list, eviction by engines with a loaded-adapter cap (the workers follow it), and a
hot adapter spread over both workers.

Two simulated workers whose engines run 2 distinct adapters per batch (the base model counting as
one) and keep at most 3 loaded; tests run in file order.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from .conftest import MODEL, Platform, read_usage, running_platform

pytestmark = pytest.mark.e2e


def digest(i: int) -> str:
    return "sha256:" + f"{i:064x}"


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(
        tmp_path_factory.mktemp("lora"), workers=2, time_scale=0.1,
        engine_args=["--max-loras-per-batch", "2", "--max-loaded-loras", "3"],
        extra_env={"INFERBUS_PLACEMENT_TIMEOUT_MS": "500", "INFERBUS_REQUEST_TIMEOUT_S": "30"},
    ) as running:
        yield running


def complete(client: openai.OpenAI, model: str, prompt: str = "hello", max_tokens: int = 4) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)


def wait_for_models(client: openai.OpenAI, names: set[str], timeout: float = 30.0) -> set[str]:
    deadline = time.monotonic() + timeout
    while True:
        seen = {card.id for card in client.models.list().data}
        if names <= seen or time.monotonic() > deadline:
            return seen
        time.sleep(0.1)


def test_a_bulk_registration_is_checked_whole_and_then_registers_every_adapter(lora: Platform) -> None:
    entries = [{"name": f"lora-{i}", "version": digest(i), "path": f"s3://adapters/lora-{i}"} for i in range(6)]
    with lora.admin() as admin:
        bad = admin.post(
            "/adapters/bulk", json={"adapters": [*entries, {"name": "x", "version": "latest", "path": "p"}]}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "adapters[6].version"
        assert admin.get("/adapters").json()["data"] == []  # nothing of a refused call is registered
        created = admin.post("/adapters/bulk", json={"adapters": entries})
        assert created.status_code == 201, created.text
        assert [a["engine_name"] for a in created.json()["data"]] == [f"lora-{i}@{digest(i)[7:19]}" for i in range(6)]
    assert wait_for_models(lora.client(), {f"lora-{i}" for i in range(6)}) >= {f"lora-{i}" for i in range(6)}


def test_the_cli_imports_a_file_of_adapters_with_a_progress_bar(lora: Platform, tmp_path: Path) -> None:
    lines = [json.dumps({"name": f"bulk-{i}", "version": digest(100 + i), "path": f"s3://adapters/bulk-{i}"})
             for i in range(25)]
    source = tmp_path / "adapters.jsonl"
    source.write_text("\n".join(lines) + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "tools.commands.main", "adapters", "import", str(source), "--chunk", "10",
         "--url", lora.stack.gateway_url, "--admin-key", lora.admin_key],
        check=False, capture_output=True, text=True, timeout=60, env=dict(os.environ, INFERBUS_PLATFORM_DIR=""),
    )
    assert result.returncode == 0, result.stderr
    assert "Registered 25 adapters." in result.stdout
    assert "Registering adapters" in result.stderr  # click draws the bar itself only on a terminal
    with lora.admin() as admin:
        names = {a["name"] for a in admin.get("/adapters").json()["data"]}
    assert {f"bulk-{i}" for i in range(25)} <= names


def test_a_tenants_adapters_list_grants_exactly_those_adapters(lora: Platform) -> None:
    with lora.admin() as admin:
        assert admin.post("/adapters", json={"name": "acme-private", "version": digest(900), "path": "s3://p",
                                             "owner": "other"}).status_code == 201
        created = admin.post("/tenants", json={"id": "acme", "models": [MODEL], "adapters": ["lora-1"]})
        assert created.status_code == 201, created.text
        secret = admin.post("/tenants/acme/keys", json={"name": "test"}).json()["secret"]
    acme = openai.OpenAI(base_url=lora.base_url, api_key=secret, max_retries=0, timeout=30)
    assert wait_for_models(acme, {MODEL, "lora-1"}) == {MODEL, "lora-1"}
    assert complete(acme, "lora-1").model == "lora-1"
    for other in ("lora-2", "acme-private"):
        with pytest.raises(openai.NotFoundError):
            complete(acme, other)
    # The default tenant (`models: ["*"]`) may use every public adapter, and no one else's private one.
    demo = {card.id for card in lora.client().models.list().data}
    assert "lora-2" in demo and "acme-private" not in demo


def worker_log_events(platform: Platform, event: str) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for log in sorted((platform.stack.config.state_dir / "logs").glob("worker-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == event:
                found.setdefault(log.stem, []).append(record)
    return found


def test_engines_evict_past_their_cap_and_workers_follow_without_failing_a_request(lora: Platform) -> None:
    client = lora.client(timeout=30)
    # Ten adapters over two engines holding three each, twice round: loads past the cap evict, and
    # a request for an evicted adapter loads it again.
    names = [f"lora-{i}" for i in range(6)] + [f"bulk-{i}" for i in range(4)]
    for round_ in range(2):
        for name in names:
            assert complete(client, name, prompt=f"round {round_}").choices[0].text
    evicted = worker_log_events(lora, "adapter_evicted")
    assert sum(len(events) for events in evicted.values()) >= 1, "no engine evicted an adapter"
    loaded = worker_log_events(lora, "adapter_loaded")
    assert all(record["loaded"] <= 3 for records in loaded.values() for record in records)


def test_a_hot_adapter_spreads_over_both_workers(lora: Platform) -> None:
    client = lora.client(timeout=30)
    complete(client, "bulk-0")  # its first home
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda i: complete(client, "bulk-0", prompt=f"busy {i}", max_tokens=48), range(48)))
    events = read_usage(lora, "demo", {r.id.removeprefix("cmpl-") for r in responses})
    per_worker: dict[str, int] = {}
    for event in events:
        per_worker[event.worker_id] = per_worker.get(event.worker_id, 0) + 1
    assert len(per_worker) == 2, per_worker
    assert min(per_worker.values()) >= 8, per_worker
