"""After `inferbus up`, the CLI uses that platform (and says so), a query that finds nothing says
so, and the launcher's state (credentials included) is private to its user."""

from __future__ import annotations

import csv
import io
import json
import re
import stat
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from inferbus.local.stack import PLATFORM_FILE
from tools.commands.main import main

from .conftest import MODEL, Platform

pytestmark = pytest.mark.e2e


def run_cli(platform: Platform, *args: str) -> tuple[str, str]:
    """Run a CLI command as a user in the directory of `inferbus up` would: no REDIS_URL, NATS_URL
    or gateway settings, only the state dir. Returns (stdout, stderr)."""
    # NATS_TLS_CA too: the CLI sets it for a --tls platform, and the runner restores only what it was given.
    env = {"INFERBUS_PLATFORM_DIR": str(platform.stack.config.state_dir), "REDIS_URL": None, "NATS_URL": None,
           "INFERBUS_URL": None, "INFERBUS_ADMIN_KEY": None, "NATS_TLS_CA": None}
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)  # type: ignore[arg-type]
    assert result.exit_code == 0, result.output
    return result.stdout, result.stderr


def test_usage_export_reads_the_running_local_platform_and_says_so(platform: Platform) -> None:
    start = int(time.time()) - 60
    client = platform.client()
    for i in range(3):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"count me {i}"}], max_tokens=4
        )
    redis_port = platform.stack.redis_url.rsplit(":", 1)[1].split("/")[0]

    deadline, rows = time.monotonic() + 30, []
    while time.monotonic() < deadline:
        out, err = run_cli(platform, "usage", "export", "--tenant", "demo", "--from", str(start), "--bucket", "1m")
        rows = list(csv.DictReader(io.StringIO(out)))
        if sum(int(r["num_model_requests"]) for r in rows) >= 3:
            break
        time.sleep(0.5)
    assert sum(int(r["num_model_requests"]) for r in rows) >= 3, (out, err)
    assert {r["tenant"] for r in rows} == {"demo"}
    assert "Using the local platform" in err and f"127.0.0.1:{redis_port}" in err
    assert platform.stack.redis_url.split("@")[0].split(":")[-1] not in err, "the Redis password is never printed"


def every_platform_command(platform: Platform, exports: Path) -> None:
    """Every CLI command that talks to a running platform, against `platform` as `inferbus up`
    left it: each finds the platform from the state dir and answers (exit code 0, no traceback).
    Shared by the one-zone platform here and the three-zone one (tests/test_e2e_zones_secure.py)."""
    start = int(time.time()) - 60
    platform.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "cli"}], max_tokens=2)
    deadline, rows = time.monotonic() + 30, []
    while time.monotonic() < deadline and not rows:  # the billing service rolls the request up
        out, err = run_cli(platform, "usage", "export", "--tenant", "demo", "--from", str(start), "--bucket", "1m")
        rows = list(csv.DictReader(io.StringIO(out)))
        time.sleep(0.2)
    assert rows and {r["tenant"] for r in rows} == {"demo"}, (out, err)
    assert "***@" in err and platform.stack.redis_url.split("@")[0].split(":")[-1] not in err

    month = time.strftime("%Y-%m", time.gmtime())
    out, err = run_cli(platform, "usage", "export-month", "--month", month, "--tenant", "demo", "--dir", str(exports))
    assert any(exports.rglob("*.csv")), (out, err)
    assert "demo" in {t["id"] for t in json.loads(run_cli(platform, "tenants", "list", "--json")[0])}
    assert "demo" in run_cli(platform, "tenants", "show", "demo")[0]
    assert run_cli(platform, "keys", "list", "--tenant", "demo")[0].strip()
    # The writes through the admin API: a tenant, a key that serves, its revocation, the tenant's end.
    tenant = f"cli-{int(time.time() * 1000) % 10**8}"
    run_cli(platform, "tenants", "create", tenant)
    secret, err = run_cli(platform, "keys", "create", "--tenant", tenant)
    assert platform.client().with_options(api_key=secret.strip()).models.list().data
    key_id = re.search(r"\b(key_\w+)", err + run_cli(platform, "keys", "list", "--tenant", tenant)[0])
    assert key_id, err
    run_cli(platform, "keys", "revoke", "--tenant", tenant, key_id.group(1))
    run_cli(platform, "tenants", "delete", tenant, "--yes")
    assert tenant not in {t["id"] for t in json.loads(run_cli(platform, "tenants", "list", "--json")[0])}
    assert isinstance(json.loads(run_cli(platform, "prices", "list", "--json")[0]), list)
    assert isinstance(json.loads(run_cli(platform, "adapters", "list", "--json")[0]), list)
    run_cli(platform, "release", "list")
    run_cli(platform, "release", "status", "--json")
    mix, err = run_cli(platform, "mix", "from-usage", "--since", str(start), "--tenant", "demo")
    assert "classes:" in mix and "requests in" in err, (mix, err)


def test_every_platform_command_works_against_one_zone(platform: Platform, tmp_path: Path) -> None:
    every_platform_command(platform, tmp_path / "exports")


def test_redact_hides_every_password_of_a_multi_host_address() -> None:
    from tools.commands.local_platform import redact

    sentinel = "redis+sentinel://:s3cret@127.0.0.1:21213,127.0.0.1:20191,127.0.0.1:29906/inferbus/0"
    assert redact(sentinel) == "redis+sentinel://:***@127.0.0.1:21213,127.0.0.1:20191,127.0.0.1:29906/inferbus/0"
    cluster = "nats://ops:pw1@127.0.0.1:1,nats://ops:pw1@127.0.0.1:2"
    assert redact(cluster) == "nats://ops:***@127.0.0.1:1,nats://ops:***@127.0.0.1:2"
    assert redact("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_an_export_that_finds_nothing_says_so(platform: Platform) -> None:
    out, err = run_cli(platform, "usage", "export", "--tenant", "no-such-tenant", "--from", str(int(time.time()) - 60))
    assert "No usage found for no-such-tenant" in err
    assert len(out.strip().splitlines()) <= 1  # at most the CSV header


def test_admin_commands_use_the_local_gateway_and_its_admin_key(platform: Platform) -> None:
    out, err = run_cli(platform, "tenants", "list", "--json")
    assert "demo" in {t["id"] for t in json.loads(out)}
    assert f"gateway {platform.stack.gateway_url}" in err


def test_the_launchers_state_is_private(platform: Platform) -> None:
    state = platform.stack.config.state_dir
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    for name in (PLATFORM_FILE, "nats.conf", "redis.conf"):
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name
    recorded = json.loads((state / PLATFORM_FILE).read_text())
    assert recorded["redis_url"] == platform.stack.redis_url and recorded["nats_user"] == "ops"
    # NATS's monitoring port (no authentication) answers on loopback only.
    monitoring = [
        line.strip() for line in (state / "nats.conf").read_text().splitlines() if line.strip().startswith("http")
    ]
    assert len(monitoring) == 1 and monitoring[0].startswith('http: "127.0.0.1:'), monitoring
    # Everything the platform's processes wrote (Redis's append-only file, JetStream's store, the
    # usage outboxes' SQLite files with their -wal and -shm, logs, the model) is theirs alone.
    names = set()
    for path in state.rglob("*"):
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            continue
        names.add(path.name)
        expected = 0o700 if path.is_dir() else 0o600
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, (path, oct(path.stat().st_mode))
        assert path.is_file() or stat.S_IMODE(path.stat().st_mode) == expected, path
    assert any(name.endswith(".aof") for name in names) and any(name.endswith("-wal") for name in names), names
    assert "gateway.log" in names


def test_usage_export_month_writes_under_the_platforms_state_dir(platform: Platform) -> None:
    month = time.strftime("%Y-%m", time.gmtime())
    platform.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "bill"}], max_tokens=2)
    exports = platform.stack.config.state_dir / "exports"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (exports / month / "demo.csv").exists():
        run_cli(platform, "usage", "export-month", "--month", month, "--tenant", "demo")
        time.sleep(0.2)
    written = exports / month / "demo.csv"
    assert written.exists(), sorted(platform.stack.config.state_dir.iterdir())
    assert stat.S_IMODE(written.stat().st_mode) == 0o600 and stat.S_IMODE(written.parent.stat().st_mode) == 0o700
    assert json.loads((platform.stack.config.state_dir / PLATFORM_FILE).read_text())["export_dir"] == str(
        exports.absolute()
    )


def test_stopping_the_platform_removes_its_secrets(tmp_path: Path) -> None:
    """nats.conf, redis.conf (passwords), tokens and the TLS private key go when `inferbus up` stops;
    the data, the logs and the CA certificate stay."""
    from inferbus.local.private_files import write_private
    from inferbus.local.stack import Stack, StackConfig

    secrets = ["nats.conf", "nats-a.conf", "redis.conf", "redis-b.conf", "sentinel-c.conf", "callout-tokens.json",
               "tokens/gateway", "tls/nats-server.key"]
    kept = ["logs/gateway.log", "tls/ca.pem", "redis-a/appendonlydir/appendonly.aof.1.incr.aof", "state/outbox.sqlite3"]
    for name in secrets + kept:
        write_private(tmp_path / name, "x")
    Stack(StackConfig(state_dir=tmp_path)).stop()
    assert [name for name in secrets if (tmp_path / name).exists()] == []
    assert [name for name in kept if not (tmp_path / name).exists()] == []


def test_a_stale_platform_file_is_not_used(tmp_path: Path) -> None:
    """A platform file whose launcher is gone (killed without cleaning up) is ignored."""
    from tools.commands import local_platform

    (tmp_path / PLATFORM_FILE).write_text(json.dumps({"launcher_pid": 2**22 + 7, "redis_url": "redis://gone:1/0"}))
    choice = local_platform.redis_url(None, tmp_path)
    assert choice.source == "default" and choice.value == local_platform.DEFAULT_REDIS_URL
    assert local_platform.redis_url("redis://:secret@db:6379/0", tmp_path).note.count("secret") == 0
