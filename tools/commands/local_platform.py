"""Which platform an `inferbus` CLI command talks to, and how it says so.

An address given on the command line or in the environment wins. Without one, a command uses the
platform `inferbus up` runs from the state dir (INFERBUS_PLATFORM_DIR, default `.inferbus`): the
launcher writes its URLs and the operator's credentials to `platform.json` there (0600) while it
runs. Failing both, the documented defaults. Every choice comes with a line that names it.
"""

from __future__ import annotations

import asyncio
import os
import re
import ssl
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from inferbus.local.stack import PLATFORM_FILE, read_platform_file

if TYPE_CHECKING:
    from nats.aio.client import Client

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_GATEWAY_URL = "http://127.0.0.1:8080"


def state_dir() -> Path:
    return Path(os.environ.get("INFERBUS_PLATFORM_DIR") or ".inferbus")


@dataclass(frozen=True)
class Choice:
    value: str
    source: str  # "option", "platform" or "default"
    note: str  # one line for the user: what is used, from where (no secrets)


# `scheme://user:password@` wherever it appears: a NATS cluster is several URLs joined by commas,
# a Sentinel or multi-host Redis address one URL with several hosts, neither parses as one URL.
_CREDENTIALS = re.compile(r"(//[^:/@,]*):[^@/,]*@")


def redact(url: str) -> str:
    """`url` without its passwords (every URL of a comma-separated list, however many hosts)."""
    return _CREDENTIALS.sub(r"\1:***@", url)


def _from_platform(directory: Path, what: str, value: str) -> Choice:
    return Choice(value, "platform", f"Using the local platform that `inferbus up` runs from {directory} "
                                     f"({directory / PLATFORM_FILE}): {what} {redact(value)}")


def redis_url(given: str | None, directory: Path | None = None) -> Choice:
    directory = state_dir() if directory is None else directory
    if given:
        return Choice(given, "option", f"Using Redis at {redact(given)} (--redis-url / REDIS_URL)")
    found = read_platform_file(directory)
    if found and found.get("redis_url"):
        return _from_platform(directory, "Redis", str(found["redis_url"]))
    return Choice(DEFAULT_REDIS_URL, "default", f"Using Redis at {DEFAULT_REDIS_URL} (the default: no --redis-url, "
                                                f"REDIS_URL or running `inferbus up` in {directory})")


def nats_url(given: str | None, directory: Path | None = None) -> Choice:
    """A NATS URL; from the local platform, with the operator's (`ops`) credentials in it."""
    directory = state_dir() if directory is None else directory
    if given:
        return Choice(given, "option", f"Using NATS at {redact(given)} (--nats-url / NATS_URL)")
    found = read_platform_file(directory)
    if found and found.get("nats_url"):
        url = str(found["nats_url"])
        user, password = str(found.get("nats_user") or ""), str(found.get("nats_password") or "")
        if found.get("nats_tls_ca") and not os.environ.get("NATS_TLS_CA"):
            # A platform started with --tls: verify its server with its CA (bus.connect reads this).
            os.environ["NATS_TLS_CA"] = str(found["nats_tls_ca"])
        if user:
            credentials = f"{urllib.parse.quote(user, safe='')}:{urllib.parse.quote(password, safe='')}"
            nodes = [urllib.parse.urlsplit(node) for node in url.split(",")]  # a cluster: every node
            url = ",".join(urllib.parse.urlunsplit(p._replace(netloc=f"{credentials}@{p.netloc}")) for p in nodes)
        return _from_platform(directory, "NATS", url)
    return Choice(DEFAULT_NATS_URL, "default", f"Using NATS at {DEFAULT_NATS_URL} (the default: no --nats-url, "
                                               f"NATS_URL or running `inferbus up` in {directory})")


async def connect_bus(url: str, name: str) -> Client:
    """The CLI's NATS connection (`connect_once`): a server it cannot reach or verify is a one-line
    error naming it, never a wait."""
    import nats.errors

    from inferbus.bus import connection as bus

    try:
        return await bus.connect_once(url, name)
    except (OSError, nats.errors.Error, asyncio.TimeoutError) as error:
        hint = " (a TLS server: set NATS_TLS_CA to the CA that signed its certificate)" \
            if isinstance(error, ssl.SSLError) else ""
        raise click.ClickException(f"cannot reach NATS at {redact(url)}: {error}{hint}") from None


@dataclass(frozen=True)
class PathChoice:
    value: Path
    source: str  # "option", "platform" or "default"


def export_dir(given: str | None, directory: Path | None = None) -> PathChoice:
    """Where monthly usage exports go: the given directory, else the running platform's (under its
    state dir), else `exports` in the state dir `inferbus up` uses by default."""
    directory = state_dir() if directory is None else directory
    if given:
        return PathChoice(Path(given), "option")
    found = read_platform_file(directory)
    if found and found.get("export_dir"):
        return PathChoice(Path(str(found["export_dir"])), "platform")
    return PathChoice(directory / "exports", "default")


def gateway(url: str | None, admin_key: str, directory: Path | None = None) -> tuple[str, str, str]:
    """(gateway URL, admin key, note): the local platform's when neither is given."""
    directory = state_dir() if directory is None else directory
    if url:
        return url, admin_key, ""
    found = read_platform_file(directory)
    if found and found.get("gateway_url"):
        chosen = str(found["gateway_url"])
        return chosen, admin_key or str(found.get("admin_key") or ""), _from_platform(directory, "gateway", chosen).note
    return DEFAULT_GATEWAY_URL, admin_key, ""


async def demo_key(redis_url: str) -> str:
    """Make sure the `demo` tenant exists (no limits) and return a new API key for it."""
    from inferbus.runtime import redis_conn
    from inferbus.stores.keys import create_key
    from inferbus.stores.tenants import Tenant, TenantExists, TenantStore

    client = redis_conn.async_client(redis_url)
    try:
        try:
            await TenantStore(client).create(Tenant(id="demo", name="Demo"))
        except TenantExists:
            pass
        return await create_key(client, "demo", name="demo")
    finally:
        await client.aclose()
