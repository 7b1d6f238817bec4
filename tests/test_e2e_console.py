"""The web console in a real headless browser (Debian's Chromium) against a real platform.

A tenant signs in with its API key and sees the requests it just made with the tokens and dollars
`inferbus usage export` writes (every number of the page, table by table), downloads the same CSV
byte for byte, creates a key, uses it, revokes it and watches it get a 401. An operator signs in
with the admin key and sees the SLOs from the gateway's own counters, a worker killed and
restarted, an adapter canary rolled back by its SLO gate, the autoscaler's decisions, the tenants
and prices. A second tenant sees none of the first one's data. Screenshots of every page are kept
under .artifacts/console (INFERBUS_ARTIFACTS_DIR), printed at the start.
"""

from __future__ import annotations

import csv
import io
import os
import signal
import sys
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from click.testing import CliRunner

from inferbus.local.process import Process
from inferbus.releases import record
from services.sim_engine import quality
from tools.commands.main import main

from .canary_helpers import Load, cli, decisions
from .conftest import MODEL, Platform, read_usage, running_platform
from .console_browser import (
    Browser,
    artifacts_dir,
    cells,
    charts_drawn,
    chromium,
    off_loop,
    secrets_in,
    sign_in,
    wait_until,
)

pytestmark = pytest.mark.e2e

SLO_TTFT_S = 3.0


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    env = {
        "INFERBUS_SLO_RECORD_INTERVAL_S": "0.5",  # the SLO page's minutes filled at once
        # An adapter canary decided in seconds (production: 200 samples, 5 minute windows).
        "INFERBUS_CANARY_MIN_SAMPLES": "40", "INFERBUS_CANARY_TICK_S": "0.5",
        # The SLO the ops page judges by, with room for a machine shared with every other test
        # (production: 0.8 s and 40 ms at real speed; these engines run at ten times it).
        "INFERBUS_SLO_TTFT_P90_S": str(SLO_TTFT_S), "INFERBUS_SLO_TPOT_P90_S": "0.2",
    }
    with running_platform(tmp_path_factory.mktemp("console"), workers=2, time_scale=0.1, extra_env=env) as running:
        yield running


@pytest.fixture(scope="module")
def autoscaler(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """An autoscaler that decides every second and carries nothing out (the dry-run actuator)."""
    stack = platform.stack
    log = tmp_path_factory.mktemp("autoscaler") / "autoscaler.log"
    env = {**os.environ, "NATS_URL": stack.nats_server_url, "INFERBUS_MODEL": MODEL, "INFERBUS_LOG_LEVEL": "info",
           "INFERBUS_AUTOSCALER_ACTUATOR": "dryrun", "INFERBUS_AUTOSCALER_TICK_S": "1", "INFERBUS_METRICS_PORT": "0",
           **stack.credentials("autoscaler")}
    process = Process("autoscaler", [sys.executable, "-m", "tools.commands.main", "autoscaler"], env, log,
                      lambda: b'"autoscaler_ready"' in log.read_bytes())
    process.start()
    try:
        wait_until(lambda: log.exists() and process.ready(), timeout=30, message=lambda: process.tail())
        yield process
    finally:
        process.signal(signal.SIGTERM)
        if not process.wait(15):
            process.signal(signal.SIGKILL)


@pytest.fixture(scope="module")
def browser(request: pytest.FixtureRequest) -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    executable = chromium()
    shots = artifacts_dir("console")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\nconsole screenshots: {shots}")
    with sync_playwright() as playwright:
        opened = Browser(playwright, executable, shots)
        try:
            yield opened
        finally:
            opened.close()
    assert not opened.errors, "errors in the browser's console:\n" + "\n".join(opened.errors)


@pytest.fixture(scope="module")
def other_key(platform: Platform) -> str:
    with platform.admin() as admin:
        admin.post("/tenants", json={"id": "other", "name": "Other Co"}).raise_for_status()
        made = admin.post("/tenants/other/keys", json={"name": "other-ci"})
        made.raise_for_status()
        return made.json()["secret"]


def today() -> tuple[str, str]:
    """The console's default window (this month through today) as `--from`/`--to` of the export."""
    import datetime as dt

    now = dt.datetime.now(dt.timezone.utc)
    return now.strftime("%Y-%m-01"), (now.date() + dt.timedelta(days=1)).isoformat()


def export(platform: Platform, tenant: str, start: str, end: str, *extra: str) -> str:
    result = off_loop(CliRunner().invoke, main, ["usage", "export", "--tenant", tenant, "--from", start, "--to", end,
                                                 "--redis-url", platform.stack.redis_url, *extra])
    assert result.exit_code == 0, result.output
    return result.stdout


def rows_of(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def sums(rows: list[dict[str, str]]) -> dict[str, str]:
    """What the page shows for `rows`: requests, tokens and exact dollars, as strings."""
    return {
        "requests": str(sum(int(r["num_model_requests"]) for r in rows)),
        "input_tokens": str(sum(int(r["input_tokens"]) for r in rows)),
        "input_cached_tokens": str(sum(int(r["input_cached_tokens"]) for r in rows)),
        "output_tokens": str(sum(int(r["output_tokens"]) for r in rows)),
        "cost_usd": str(sum((Decimal(r["cost_usd"]) for r in rows), Decimal("0.000000"))),
    }


def chat(client: openai.OpenAI, words: str, max_tokens: int, model: str = MODEL) -> str:
    reply = client.chat.completions.create(model=model, max_tokens=max_tokens,
                                           messages=[{"role": "user", "content": words}])
    return reply.id.removeprefix("chatcmpl-")


# ---- tenant ------------------------------------------------------------------------------------

def test_a_tenant_sees_its_requests_with_the_exports_tokens_and_dollars(platform: Platform, browser: Browser,
                                                                          tmp_path: Path) -> None:
    client = platform.client()
    ids = {chat(client, f"Question {i}: " + "word " * (5 + 7 * i), 4 + 3 * i) for i in range(6)}
    # The ledger (the USAGE stream) is the independent count: what the workers reported.
    events = off_loop(read_usage, platform, "demo", ids, timeout=20)
    assert {e.request_id for e in events} == ids
    start, end = today()

    def rolled_up() -> bool:
        return int(sums(rows_of(export(platform, "demo", start, end)))["requests"]) >= len(ids)

    wait_until(rolled_up, timeout=30, message="the billing service never rolled the requests up")
    hourly = export(platform, "demo", start, end)
    rows = rows_of(hourly)
    assert int(sums(rows)["requests"]) == len(ids)  # this module's platform saw these requests only
    assert sums(rows)["input_tokens"] == str(sum(e.usage.prompt_tokens for e in events))
    assert sums(rows)["output_tokens"] == str(sum(e.usage.completion_tokens for e in events))

    with browser.viewer() as page:
        sign_in(page, platform.stack.gateway_url, platform.api_key)
        assert page.url.endswith("/console/usage"), page.url
        assert page.inner_text("#who") == "tenant demo"
        totals = dict(
            page.eval_on_selector_all("[data-total]", "es => es.map(e => [e.dataset.total, e.dataset.value])")
        )
        assert totals == {**sums(rows), **{n: str(sum(int(r[n]) for r in rows))
                                           for n in ("num_cancelled_requests", "num_failed_requests")}}
        assert page.inner_text("[data-total=cost_usd]") == "$" + sums(rows)["cost_usd"]
        # Every table's every line: the sum of the export's rows with that line's value.
        lines = cells(page, "table[id^=by-]")
        assert {line["table"] for line in lines} == {"by-day", "by-model", "by-adapter", "by-band", "by-release",
                                                      "by-api_key_id"}
        for line in lines:
            column = line["table"].removeprefix("by-")
            if line["key"] == "(total)":
                matching = rows
            elif column == "day":
                matching = [r for r in rows if r["bucket_start"].startswith(line["key"])]
            else:
                matching = [r for r in rows if r[column] == line["key"]]
            assert matching, line
            assert line["values"] == sums(matching), (line, column)
        assert all(charts_drawn(page)), "a chart was not drawn"
        # The page names the export it is made of.
        assert (
            page.inner_text("#page-command")
            == f"inferbus usage export --tenant demo --from {start} --to {end} --bucket 1d"
        )
        browser.shot(page, "tenant-usage")

        # The CSV download is the export, byte for byte.
        with page.expect_download() as download:
            page.click("#csv-hourly")
        saved = tmp_path / "usage.csv"
        download.value.save_as(saved)
        assert saved.read_text() == hourly
        with page.expect_download() as download:
            page.click("#csv-daily")
        download.value.save_as(saved)
        assert saved.read_text() == export(platform, "demo", start, end, "--bucket", "1d")


def test_a_tenant_creates_a_key_uses_it_and_revokes_it(platform: Platform, browser: Browser) -> None:
    with browser.viewer() as page:
        sign_in(page, platform.stack.gateway_url, platform.api_key)
        page.click("a[href='/console/keys']")
        page.fill("input[name=name]", "made-in-the-console")
        page.click("#create")
        secret = page.inner_text("#new-secret")
        assert secret.startswith("ib-") and len(secret) > 40
        browser.shot(page, "tenant-key-created")
        key_id = page.eval_on_selector("tr[data-key] >> text=made-in-the-console",
                                       "e => e.closest('tr').dataset.key")
        new_client = openai.OpenAI(base_url=platform.base_url, api_key=secret, max_retries=0)
        chat(new_client, "hello from the new key", 3)

        # Shown once: never again on any page, its last use noted within a minute.
        def used() -> bool:
            page.goto(platform.stack.gateway_url + "/console/keys")
            row = next(r for r in cells(page, "#keys") if r["key"] == key_id)
            return row["values"]["last_used"] != ""

        wait_until(used, timeout=10, message="the key's last use never showed")
        assert secret not in page.content() and not secrets_in(page.content())
        browser.shot(page, "tenant-keys")

        page.click(f"[data-revoke={key_id}]")  # confirms the dialog
        page.wait_for_url("**/console/keys")
        assert key_id not in [r["key"] for r in cells(page, "#keys")]
        # At once, not after the gateway's key cache expires (10 s on this platform).
        with pytest.raises(openai.AuthenticationError):
            chat(new_client, "still there?", 3)
        chat(platform.client(), "the session's own key still works", 3)


def test_a_tenant_sees_its_limits_batches_files_and_adapters(platform: Platform, browser: Browser,
                                                             tmp_path: Path) -> None:
    with platform.admin() as admin:
        # 6 a minute refill one request every 10 s: the page sees most of the 3 requests below in use.
        admin.patch("/tenants/demo", json={"limits": {"requests_per_minute": 6, "monthly_budget_usd": 5.0}}
                    ).raise_for_status()
    client = platform.client()
    counted = time.monotonic()  # refilling from the first request on at most
    for i in range(3):
        chat(client, f"count {i}", 3)
    upload = client.files.create(file=("lines.jsonl", b'{"custom_id": "a", "method": "POST", "url": '
                                                      b'"/v1/chat/completions", "body": {"model": "' + MODEL.encode()
                                       + b'", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}}\n'),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    adapter = tmp_path / "demo-style"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    with platform.admin() as admin:
        for name, owner in (("demo-style", "demo"), ("other-style", "other")):
            admin.post("/adapters", json={"name": name, "version": record.directory_digest(adapter),
                                          "path": str(adapter), "owner": owner}).raise_for_status()

    with browser.viewer() as page:
        sign_in(page, platform.stack.gateway_url, platform.api_key)
        page.goto(platform.stack.gateway_url + "/console/limits")
        limits = {row["key"]: row["values"] for row in cells(page, "#limits")}
        assert set(limits) == {"requests_per_minute", "monthly_budget_usd"}
        assert float(limits["requests_per_minute"]["limit"]) == 6
        # The 3 requests (the batch's line is not counted here), less what refilled since.
        refilled = (time.monotonic() - counted) / 10
        assert 3 - refilled - 0.2 < float(limits["requests_per_minute"]["used"]) <= 3, (refilled, limits)
        assert 0 < float(limits["monthly_budget_usd"]["used"]) < 5.0
        browser.shot(page, "tenant-limits")
        with platform.admin() as admin:  # the other tests' traffic is not limited
            admin.patch("/tenants/demo", json={"limits": {"requests_per_minute": None}}).raise_for_status()

        page.goto(platform.stack.gateway_url + "/console/batches")
        assert batch.id in [r["key"] for r in cells(page, "#batches")]
        assert upload.id in [r["key"] for r in cells(page, "#files")]
        browser.shot(page, "tenant-batches")

        def listed() -> bool:  # the gateway's catalog follows the registry
            page.goto(platform.stack.gateway_url + "/console/adapters")
            return "demo-style" in [r["key"] for r in cells(page, "#adapters")]

        wait_until(listed, timeout=10, message="the tenant's adapter never showed")
        assert "other-style" not in page.content()
        browser.shot(page, "tenant-adapters")


def test_a_tenant_never_sees_another_tenants_data(platform: Platform, browser: Browser, other_key: str) -> None:
    base = platform.stack.gateway_url
    other = openai.OpenAI(base_url=platform.base_url, api_key=other_key, max_retries=0)
    chat(other, "the other tenant's question", 5)
    with platform.admin() as admin:
        demo_keys = [k["id"] for k in admin.get("/tenants/demo/keys").json()["data"]]
    demo_batches = [b.id for b in platform.client().batches.list()]
    demo_files = [f.id for f in platform.client().files.list()]
    start, end = today()
    wait_until(lambda: rows_of(export(platform, "other", start, end)), timeout=30, message="other's usage")
    with browser.viewer() as page:
        sign_in(page, base, other_key)
        assert page.inner_text("#who") == "tenant other"
        for path in ("/console/usage", "/console/keys", "/console/limits", "/console/batches", "/console/adapters",
                     "/console/usage?tenant=demo"):
            page.goto(base + path)
            html = page.content()
            leaked = [x for x in [*demo_keys, *demo_batches, *demo_files, "demo-style", "demo ("] if x in html]
            assert not leaked, (path, leaked)
        page.goto(base + "/console/usage")
        assert page.get_attribute("[data-total=requests]", "data-value") == "1"
        browser.shot(page, "other-tenant-usage")
        # A form naming the first tenant's key, with the second tenant's valid token: not found.
        token = page.get_attribute("input[name=csrf_token]", "value")
        answer = page.request.post(base + f"/console/keys/{demo_keys[0]}/revoke", form={"csrf_token": token},
                                   max_redirects=0)
        assert answer.status == 404
        chat(platform.client(), "demo's key still works", 3)
        # An operator's page is not a tenant's, nor is another tenant's usage through the operator's URL.
        assert page.request.get(base + "/console/ops").status == 403
        assert page.request.get(base + "/console/ops/tenants/demo/usage").status == 403
        assert page.request.get(base + "/console/ops/tenants/demo/usage.csv").status == 403
    # The CSV with the other tenant's key holds its rows only.
    csv_text = httpx.get(base + "/console/usage.csv", headers={"authorization": f"Bearer {other_key}"}).text
    assert {r["tenant"] for r in rows_of(csv_text)} == {"other"}
    assert csv_text == export(platform, "other", start, end)
    assert httpx.get(base + "/console/usage.csv").status_code == 401


def test_sign_in_sessions_and_csrf(platform: Platform) -> None:
    base = platform.stack.gateway_url
    with httpx.Client(base_url=base, follow_redirects=False) as web:
        assert web.get("/console/usage").headers["location"].startswith("/console/login")
        form = web.get("/console/login")
        assert "default-src 'none'" in form.headers["content-security-policy"]
        assert form.headers["x-frame-options"] == "DENY" and form.headers["x-content-type-options"] == "nosniff"
        assert form.headers["cache-control"] == "no-store"
        token = form.text.split('name="csrf_token" value="')[1].split('"')[0]
        # The sign-in form's token must come with its cookie, from this site.
        assert web.post("/console/login", data={"key": platform.api_key}).status_code == 403
        assert web.post("/console/login", data={"key": platform.api_key, "csrf_token": token},
                        headers={"origin": "https://evil.example"}).status_code == 403
        bad = web.post("/console/login", data={"key": "ib-not-a-key", "csrf_token": token})
        assert bad.status_code == 401 and "ib-not-a-key" not in bad.text
        token = bad.text.split('name="csrf_token" value="')[1].split('"')[0]
        signed = web.post("/console/login", data={"key": platform.api_key, "csrf_token": token})
        assert signed.status_code == 303 and signed.headers["location"] == "/console/usage"
        cookie = next(h for h in signed.headers.get_list("set-cookie") if h.startswith("inferbus_console="))
        assert {"httponly", "samesite=strict", "path=/console"} <= {p.strip().lower() for p in cookie.split(";")}
        keys_page = web.get("/console/keys")
        assert keys_page.status_code == 200 and platform.api_key not in keys_page.text
        csrf = keys_page.text.split('name="csrf_token" value="')[1].split('"')[0]

        def key_count() -> int:
            with platform.admin() as admin:
                return len(admin.get("/tenants/demo/keys").json()["data"])

        before = key_count()
        assert web.post("/console/keys", data={"name": "no-token"}).status_code == 403
        assert web.post("/console/keys", data={"name": "wrong", "csrf_token": "x" * 43}).status_code == 403
        assert web.post("/console/keys", data={"name": "cross-site", "csrf_token": csrf},
                        headers={"origin": "https://evil.example"}).status_code == 403
        assert web.post("/console/keys", data={"name": "cross-site", "csrf_token": csrf},
                        headers={"sec-fetch-site": "cross-site"}).status_code == 403
        assert key_count() == before
        made = web.post("/console/keys", data={"name": "with-token", "csrf_token": csrf})
        assert made.status_code == 201 and key_count() == before + 1
        # Signing out ends the session: the cookie opens nothing any more.
        assert web.post("/console/logout", data={"csrf_token": csrf}).status_code == 303
        web.cookies.set("inferbus_console", cookie.split(";")[0].split("=", 1)[1], path="/console")
        assert web.get("/console/usage").status_code == 303

    # A session made from a key ends when that key is revoked.
    with platform.admin() as admin:
        made = admin.post("/tenants/demo/keys", json={"name": "short-lived"}).json()
    with httpx.Client(base_url=base, follow_redirects=False) as web:
        token = web.get("/console/login").text.split('name="csrf_token" value="')[1].split('"')[0]
        assert web.post("/console/login", data={"key": made["secret"], "csrf_token": token}).status_code == 303
        assert web.get("/console/usage").status_code == 200
        with platform.admin() as admin:
            admin.delete(f"/tenants/demo/keys/{made['id']}").raise_for_status()
        assert web.get("/console/usage").status_code == 303


# ---- operator ----------------------------------------------------------------------------------

def gateway_requests(platform: Platform) -> int:
    """inferbus_requests_total summed over its label sets, from the gateway's /metrics."""
    text = httpx.get(platform.stack.gateway_url + "/metrics").text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("inferbus_requests_total{")))


def test_an_operator_sees_the_slos_from_the_gateways_counters(platform: Platform, browser: Browser) -> None:
    client = platform.client()
    for i in range(4):
        chat(client, f"operator's traffic {i}", 3)
    with browser.viewer() as page:
        sign_in(page, platform.stack.gateway_url, platform.admin_key)
        assert page.url.endswith("/console/ops") and page.inner_text("#who") == "operator"
        expected = gateway_requests(platform)

        def recorded() -> bool:
            page.goto(platform.stack.gateway_url + "/console/ops")
            day = next(r for r in cells(page, "#slo") if r["key"] == "day")
            return day["values"]["requests"] == str(expected)

        wait_until(
            recorded, timeout=10, message=lambda: f"the SLO page never counted the gateway's {expected} requests"
        )
        now = next(r for r in cells(page, "#slo") if r["key"] == "now")["values"]
        assert 0 < float(now["ttft_p90"]) < SLO_TTFT_S and now["met"] == "met"
        assert all(charts_drawn(page))
        assert not secrets_in(page.content())  # the admin key is never rendered
        browser.shot(page, "ops-slo")


def test_an_operator_sees_a_worker_killed_and_restarted(platform: Platform, browser: Browser) -> None:
    base = platform.stack.gateway_url
    worker = platform.stack.get("worker-1")
    with browser.viewer() as page:
        sign_in(page, base, platform.admin_key)

        def state(wanted: set[str]) -> dict[str, Any] | None:
            page.goto(base + "/console/ops/fleet")
            row = next((r for r in cells(page, "#workers") if r["key"] == "worker-1"), None)
            return row if row is not None and row["state"] in wanted else None

        before = wait_until(lambda: state({"ready"}), timeout=10, message="worker-1 never showed ready")
        started = page.get_attribute("#workers tr[data-key=worker-1]", "data-started")
        assert before["values"]["role"] == "aggregated"
        browser.shot(page, "ops-fleet")
        worker.signal(signal.SIGKILL)
        worker.wait(10)
        wait_until(lambda: state({"silent", "gone"}), timeout=15, message="the killed worker never left the fleet")
        browser.shot(page, "ops-fleet-worker-killed")
        worker.start()
        wait_until(lambda: state({"ready"}), timeout=30, message=lambda: "worker-1 never came back:\n" + worker.tail())
        assert float(page.get_attribute("#workers tr[data-key=worker-1]", "data-started") or 0) > float(started or 0)
        assert "restarted" in page.inner_text("#workers tr[data-key=worker-1] [data-col=state]")
        browser.shot(page, "ops-fleet-worker-restarted")


def test_an_operator_sees_an_adapter_canary_rolled_back_by_its_gate(platform: Platform, browser: Browser,
                                                                     tmp_path: Path) -> None:
    base = platform.stack.gateway_url
    v1_dir = tmp_path / "router-v1"
    v1_dir.mkdir()
    (v1_dir / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (v1_dir / "adapter_model.safetensors").write_bytes(b"router-v1" * 100)
    quality.write_accuracy(v1_dir, 0.95)
    v1 = record.directory_digest(v1_dir)
    v2 = "sha256:" + "ab" * 32
    with platform.admin() as admin:
        admin.post("/adapters", json={"name": "acme-router", "version": v1, "path": str(v1_dir), "owner": "demo"}
                   ).raise_for_status()
    with Load(platform, platform.api_key, "acme-router", 6, "routing") as load:
        time.sleep(1)
        # The candidate's files are not where the workers look: every request it gets fails to load
        # it and goes on to the registered version, and the SLO gate sees its error rate.
        off_loop(
            cli,
            platform,
            "release",
            "adapter-canary",
            "acme-router",
            "--path",
            "missing/acme-router-v2",
            "--version",
            v2,
            "--traffic",
            "50%",
            "--steps",
            "100%",
            "--window",
            "60s",
        )
        seen = off_loop(decisions, platform, "acme-router", {"rollback", "promote"}, timeout=90)
    assert load.errors == []
    assert seen and seen[-1].action == "rollback", [(d.action, d.reason) for d in seen]
    with browser.viewer() as page:
        sign_in(page, base, platform.admin_key)
        page.goto(base + "/console/ops/releases")
        rollout = page.locator("article.rollout[data-key=acme-router]")
        assert rollout.get_attribute("data-state") == "rolled_back"
        assert "SLO gate failed" in rollout.locator("[data-col=reason]").inner_text()
        shown = [r for r in cells(page, "#release-decisions") if r["key"] == "acme-router"]
        assert any(r["values"]["action"] == "rollback" and "SLO gate failed" in r["values"]["reason"] for r in shown), (
            shown
        )
        browser.shot(page, "ops-releases")
    with browser.viewer() as page:
        sign_in(page, base, platform.api_key)
        page.goto(base + "/console/adapters")
        row = next(r for r in cells(page, "#adapters") if r["key"] == "acme-router")
        assert "rolled_back" in row["values"]["canary"]
        browser.shot(page, "tenant-adapter-canary")


def test_an_operator_sees_the_autoscalers_decisions_tenants_and_prices(platform: Platform, browser: Browser,
                                                                        autoscaler: Process, other_key: str) -> None:
    base = platform.stack.gateway_url
    start, end = today()
    with browser.viewer() as page:
        sign_in(page, base, platform.admin_key)

        def decided() -> bool:
            page.goto(base + "/console/ops/autoscaler")
            return page.locator(f"article[data-key='{MODEL}'] [data-col=reason]").count() == 1

        wait_until(decided, timeout=20, message=lambda: "no autoscaler decision shown:\n" + autoscaler.tail())
        assert page.locator(f"article[data-key='{MODEL}'] [data-col=direction]").inner_text() in ("up", "down", "hold")
        assert all(charts_drawn(page))
        browser.shot(page, "ops-autoscaler")

        page.goto(base + "/console/ops/tenants")
        tenants = {r["key"]: r["values"] for r in cells(page, "#tenants")}
        assert {"demo", "other"} <= set(tenants)
        for tenant in ("demo", "other"):
            exported = sums(rows_of(export(platform, tenant, start, end)))
            assert tenants[tenant]["requests"] == f"{int(exported['requests']):,}"
            assert tenants[tenant]["cost"] == "$" + exported["cost_usd"]
        assert page.locator("#prices tbody tr").count() >= 1
        browser.shot(page, "ops-tenants")

        # An operator opens a tenant's usage: the tenant's own page, the same export.
        page.click("#tenants a[href='/console/ops/tenants/demo/usage']")
        assert page.inner_text("#usage-tenant") == "demo"
        totals = dict(
            page.eval_on_selector_all("[data-total]", "es => es.map(e => [e.dataset.total, e.dataset.value])")
        )
        exported = rows_of(export(platform, "demo", start, end))
        assert {k: totals[k] for k in sums(exported)} == sums(exported)
        with page.expect_download() as download:
            page.click("#csv-hourly")
        assert Path(download.value.path()).read_text() == export(platform, "demo", start, end)
        browser.shot(page, "ops-tenant-usage")
