"""`inferbus tenants …` and `inferbus keys …`: tenants, their limits and their API keys, through
the gateway's admin API."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

from proto import bands
from tools.commands.admin_api import AdminAPI, admin_options, quote, table, when


class _Unlimited:
    def __repr__(self) -> str:
        return "unlimited"


UNLIMITED = _Unlimited()


class _Limit(click.ParamType):
    """A positive number, or `unlimited` to remove the limit."""

    def __init__(self, kind: type) -> None:
        self.kind = kind
        self.name = "INTEGER|unlimited" if kind is int else "DOLLARS|unlimited"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value is UNLIMITED or isinstance(value, self.kind):
            return value
        if str(value).lower() in ("unlimited", "none"):
            return UNLIMITED
        try:
            number = self.kind(value)
        except ValueError:
            self.fail(f"{value!r} is not a number or `unlimited`", param, ctx)
        if number < (1 if self.kind is int else 0):
            self.fail(f"{value} is too small (use `unlimited` for no limit)", param, ctx)
        return number


_LIMIT_OPTIONS = (  # (option, TenantLimits field, type, help)
    ("--rpm", "requests_per_minute", int, "Requests per minute."),
    ("--input-tpm", "input_tokens_per_minute", int, "Prompt tokens per minute."),
    ("--output-tpm", "output_tokens_per_minute", int, "Generated tokens per minute."),
    ("--max-concurrent", "max_concurrent", int, "Requests running at the same time."),
    ("--budget-usd", "monthly_budget_usd", float, "Spend allowed per calendar month, in US dollars."),
)


def _split(value: str | None) -> list[str] | None:
    return None if value is None else [part.strip() for part in value.split(",") if part.strip()]


def _tenant_options(command: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--name", default=None, help="Display name."),
        click.option("--band", default=None, type=click.Choice(bands.INTERACTIVE),
                     help="Priority band: premium is served first and shed last under overload (default standard)."),
        click.option("--weight", default=None, type=click.FloatRange(min=0, min_open=True),
                     help="Fair-share weight within its band: under contention a tenant gets capacity in "
                          "proportion to its weight (default 1)."),
        *[click.option(flag, field, default=None, type=_Limit(kind),
                       help=f"{text} `unlimited` (the default) removes the limit.")
          for flag, field, kind, text in _LIMIT_OPTIONS],
        click.option("--models", default=None, metavar="A,B",
                     help="Comma-separated model ids the tenant may use; `*` (the default) means every served model."),
        click.option("--adapters", default=None, metavar="A,B",
                     help="Comma-separated public LoRA adapters the tenant may use besides what --models allows; `*`: "
                          "every public adapter (default none; its own private adapters it may always use)."),
        click.option("--disabled/--enabled", "disabled", default=None,
                     help="A disabled tenant's keys are refused (default enabled)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _tenant_fields(options: dict[str, Any]) -> dict[str, Any]:
    """The API body for the tenant options that were given (None: not given)."""
    body: dict[str, Any] = {}
    for name in ("name", "band", "weight", "disabled"):
        if options[name] is not None:
            body[name] = options[name]
    for name in ("models", "adapters"):
        if options[name] is not None:
            body[name] = _split(options[name])
    limits = {field: None if options[field] is UNLIMITED else options[field]
              for _, field, _, _ in _LIMIT_OPTIONS if options[field] is not None}
    if limits:
        body["limits"] = limits
    return body


def _limit(value: Any, dollars: bool = False, unlimited: str = "unlimited") -> str:
    if value is None:
        return unlimited
    return f"${value:,.2f}" if dollars else f"{value:,}"



def _show_tenant(tenant: dict[str, Any]) -> None:
    limits = tenant["limits"]
    lines = [
        ("id", tenant["id"]),
        ("name", tenant["name"] or "-"),
        ("state", "disabled" if tenant["disabled"] else "enabled"),
        ("band", tenant["band"]),
        ("weight", f"{tenant['weight']:g}"),
        *[(flag.lstrip("-"), _limit(limits[field], dollars=kind is float)) for flag, field, kind, _ in _LIMIT_OPTIONS],
        ("models", ", ".join(tenant["models"]) or "(none)"),
        ("adapters", ", ".join(tenant["adapters"]) or "(none)"),
        ("created", when(tenant["created"])),
        ("updated", when(tenant["updated"])),
    ]
    for label, value in lines:
        click.echo(f"{label + ':':<16}{value}")


@click.group()
def tenants() -> None:
    """Manage tenants through the gateway's admin API (--url, --admin-key).

    A tenant has a priority band and fair-share weight, rate limits (requests and tokens per
    minute, concurrent requests), a monthly budget in dollars, and the models and adapters it may
    use. Its API keys are managed with `inferbus keys`.
    """


@tenants.command("create")
@click.argument("tenant_id", metavar="ID")
@_tenant_options
@admin_options
def tenants_create(tenant_id: str, url: str | None, admin_key: str, **options: Any) -> None:
    """Create tenant ID (lowercase letters, digits and '-'); unspecified limits are unlimited."""
    tenant = AdminAPI(url, admin_key).call("POST", "/tenants", {"id": tenant_id, **_tenant_fields(options)})
    click.echo(f"Created tenant '{tenant['id']}'. "
               f"Create its API key with: inferbus keys create --tenant {tenant['id']}")


@tenants.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the tenants as JSON.")
@admin_options
def tenants_list(url: str | None, admin_key: str, as_json: bool) -> None:
    """List every tenant with its band, weight, limits (`-`: unlimited) and models."""
    found = AdminAPI(url, admin_key).call("GET", "/tenants")["data"]
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    if not found:
        click.echo("No tenants. Create one with: inferbus tenants create ID")
        return
    rows = []
    for t in found:
        limits = t["limits"]
        rows.append([t["id"], t["name"], t["band"], f"{t['weight']:g}",
                     *[_limit(limits[field], dollars=kind is float, unlimited="-")
                       for _, field, kind, _ in _LIMIT_OPTIONS],
                     ",".join(t["models"]), "disabled" if t["disabled"] else "enabled"])
    click.echo(table(["ID", "NAME", "BAND", "WEIGHT", "RPM", "INPUT TPM", "OUTPUT TPM", "CONCURRENT",
                       "BUDGET/MONTH", "MODELS", "STATE"], rows))


@tenants.command("show")
@click.argument("tenant_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="Print the tenant as JSON.")
@admin_options
def tenants_show(tenant_id: str, url: str | None, admin_key: str, as_json: bool) -> None:
    """Show tenant ID: every setting, limits included."""
    tenant = AdminAPI(url, admin_key).call("GET", f"/tenants/{quote(tenant_id)}")
    if as_json:
        click.echo(json.dumps(tenant, indent=2))
    else:
        _show_tenant(tenant)


@tenants.command("update")
@click.argument("tenant_id", metavar="ID")
@_tenant_options
@admin_options
def tenants_update(tenant_id: str, url: str | None, admin_key: str, **options: Any) -> None:
    """Change the given settings of tenant ID; the others stay as they are.

    Gateways pick up the change within a few seconds (their tenant cache).
    """
    changes = _tenant_fields(options)
    if not changes:
        raise click.UsageError("nothing to change: give at least one option (see --help).")
    _show_tenant(AdminAPI(url, admin_key).call("PATCH", f"/tenants/{quote(tenant_id)}", changes))


@tenants.command("delete")
@click.argument("tenant_id", metavar="ID")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@admin_options
def tenants_delete(tenant_id: str, url: str | None, admin_key: str, yes: bool) -> None:
    """Delete tenant ID and revoke all its API keys."""
    api = AdminAPI(url, admin_key)
    if not yes:
        click.confirm(f"Delete tenant '{tenant_id}' and revoke all its API keys?", abort=True)
    api.call("DELETE", f"/tenants/{quote(tenant_id)}")
    click.echo(f"Deleted tenant '{tenant_id}' and revoked its keys.")


@click.group()
def keys() -> None:
    """Manage tenants' API keys through the gateway's admin API (--url, --admin-key).

    A secret is shown once, when it is created; Redis stores only its SHA-256 hash.
    """


@keys.command("create")
@click.option("--tenant", "tenant_id", required=True, metavar="ID", help="Tenant the key belongs to.")
@click.option("--name", default="", help="A label to recognise the key by (e.g. where it is used).")
@admin_options
def keys_create(tenant_id: str, name: str, url: str | None, admin_key: str) -> None:
    """Create an API key for a tenant and print its secret, which is not shown again.

    The secret alone goes to stdout (so `KEY=$(inferbus keys create --tenant acme)` works);
    the key id and the warning go to stderr.
    """
    issued = AdminAPI(url, admin_key).call("POST", f"/tenants/{quote(tenant_id)}/keys", {"name": name})
    click.echo(issued["secret"])
    click.echo(f"Created key {issued['id']} for tenant '{tenant_id}'. Save the secret above now: "
               "it is not shown again (only its hash is stored).", err=True)


@keys.command("list")
@click.option("--tenant", "tenant_id", required=True, metavar="ID", help="Tenant whose keys to list.")
@admin_options
def keys_list(tenant_id: str, url: str | None, admin_key: str) -> None:
    """List a tenant's keys: id, name, creation time, the secret's last 4 characters and when a
    gateway last authenticated a request with it (to within a minute)."""
    found = AdminAPI(url, admin_key).call("GET", f"/tenants/{quote(tenant_id)}/keys")["data"]
    if not found:
        click.echo(f"Tenant '{tenant_id}' has no keys. Create one with: inferbus keys create --tenant {tenant_id}")
        return
    rows = [[k["id"], k["name"], when(k["created"]), f"ib-…{k['last4']}",
             when(k["last_used"]) if k.get("last_used") else "never"] for k in found]
    click.echo(table(["ID", "NAME", "CREATED", "SECRET", "LAST USED"], rows))


@keys.command("revoke")
@click.option("--tenant", "tenant_id", required=True, metavar="ID", help="Tenant the key belongs to.")
@click.argument("key_id", metavar="KEY_ID")
@admin_options
def keys_revoke(tenant_id: str, key_id: str, url: str | None, admin_key: str) -> None:
    """Revoke key KEY_ID (from `inferbus keys list`).

    Gateways cache key lookups for INFERBUS_KEY_CACHE_TTL_S (10 s by default), so a revoked key
    can keep working that long.
    """
    AdminAPI(url, admin_key).call("DELETE", f"/tenants/{quote(tenant_id)}/keys/{quote(key_id)}")
    click.echo(f"Revoked key {key_id} of tenant '{tenant_id}' (gateways may accept it for up to "
               "INFERBUS_KEY_CACHE_TTL_S more seconds).")
