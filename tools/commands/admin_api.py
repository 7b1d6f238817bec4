"""The gateway's admin API as the CLI's operator commands use it: a client that turns every failure
into a readable message, the --url/--admin-key options, and the plain-text table and time they
print (`tenants`, `keys`, `adapters`, `prices`, `release`)."""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import click

from tools.commands.local_platform import DEFAULT_GATEWAY_URL as DEFAULT_URL


class AdminAPI:
    """A small client of the gateway's admin API that turns every failure into a readable message."""

    def __init__(self, url: str | None, admin_key: str) -> None:
        from tools.commands import local_platform

        url, admin_key, note = local_platform.gateway(url, admin_key)
        if note:
            click.echo(note, err=True)
        if not admin_key:
            raise click.UsageError("no admin key: pass --admin-key or set INFERBUS_ADMIN_KEY "
                                   "(`inferbus up` prints one; a gateway has it as INFERBUS_ADMIN_KEY).")
        self.url = url.rstrip("/")
        self.admin_key = admin_key

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        try:
            response = httpx.request(method, f"{self.url}/admin/v1{path}", json=body, timeout=10,
                                     headers={"authorization": f"Bearer {self.admin_key}"})
        except httpx.HTTPError as error:
            raise click.ClickException(f"cannot reach the gateway at {self.url} ({error.__class__.__name__}: {error}); "
                                       "is it running? Set --url or INFERBUS_URL to its address.") from None
        if response.is_success:
            return response.json()
        try:
            detail = response.json()["error"]
            message, code, param = detail["message"], detail.get("code"), detail.get("param")
        except Exception:
            message, code, param = response.text[:200] or response.reason_phrase, None, None
        if response.status_code == 401:
            raise click.ClickException(f"the gateway refused the admin key: {message} "
                                       "Use the gateway's INFERBUS_ADMIN_KEY (`inferbus up` prints it).")
        if code == "unknown_url":
            raise click.ClickException(f"no admin API at {self.url}: the gateway runs without INFERBUS_ADMIN_KEY "
                                       "(which turns the admin API off), or this is not an inferbus gateway.")
        where = f" (field `{param}`)" if param and f"`{param}`" not in message and f"$.{param}`" not in message else ""
        raise click.ClickException(f"{message}{where} [HTTP {response.status_code}]")


def admin_options(command: Callable[..., Any]) -> Callable[..., Any]:
    command = click.option("--admin-key", envvar="INFERBUS_ADMIN_KEY", default="", metavar="KEY",
                           help="Admin key of the gateway (env INFERBUS_ADMIN_KEY; `inferbus up` prints it).")(command)
    return click.option("--url", envvar="INFERBUS_URL", default=None,
                        help="Gateway base URL, without /v1 (env INFERBUS_URL). Default: the local platform "
                             "`inferbus up` runs from INFERBUS_PLATFORM_DIR (.inferbus), with its admin key; else "
                             f"{DEFAULT_URL}.")(command)


def quote(segment: str) -> str:
    return urllib.parse.quote(segment, safe="")


def when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(timestamp)) if timestamp else "-"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in [headers, *rows])

