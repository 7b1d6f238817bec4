"""`inferbus adapters …`: LoRA adapters of the served base model, through the gateway's admin API."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from tools.commands.admin_api import AdminAPI, admin_options, quote, table, when


@click.group()
def adapters() -> None:
    """Register LoRA adapters of the served base model (--url, --admin-key).

    An adapter is pinned to a version digest (sha256:<64 hex>): every worker loads exactly those
    weights, on first use. Tenants call it by name (`model: NAME`): a private one (--owner) its
    owner only, a public one tenants whose `adapters` or `models` list allows it. `import`
    registers many from a file.
    """


@adapters.command("register")
@click.argument("name")
@click.option("--version", "version", required=True, metavar="sha256:HEX",
              help="Digest of the adapter's weights; moving tags such as `latest` are refused.")
@click.option("--path", required=True, help="Where engines load the weights from (as SGLang's --lora-paths).")
@click.option("--owner", default=None, metavar="TENANT",
              help="Only this tenant may use it (default: any tenant allowed the name).")
@admin_options
def adapters_register(name: str, version: str, path: str, owner: str | None, url: str | None, admin_key: str) -> None:
    """Register adapter NAME (or point NAME at a new version, for all its requests at once; to
    canary a new version within its requests instead: `inferbus release adapter-canary`)."""
    spec = AdminAPI(url, admin_key).call("POST", "/adapters",
                                         {"name": name, "version": version, "path": path, "owner": owner})
    click.echo(f"Registered {spec['name']} (engines load it as {spec['engine_name']}) from {spec['path']}.")


@adapters.command("import")
@click.argument("file", type=click.File("r"))
@click.option("--chunk", default=100, show_default=True, type=click.IntRange(1, 1000),
              help="Adapters per admin API call (POST /admin/v1/adapters/bulk).")
@admin_options
def adapters_import(file: Any, chunk: int, url: str | None, admin_key: str) -> None:
    """Register many adapters from FILE (`-` for stdin): a JSON array of adapter objects, or one
    object per line (JSON lines), each with `name`, `version` (sha256:<64 hex>), `path` and
    optionally `owner`. Every entry is checked before any is sent; each chunk is all or nothing."""
    entries = _adapter_entries(file.read(), getattr(file, "name", "input"))
    api = AdminAPI(url, admin_key)
    done = 0
    with click.progressbar(length=len(entries), label="Registering adapters", file=sys.stderr,
                           show_pos=True) as bar:
        for start in range(0, len(entries), chunk):
            part = entries[start:start + chunk]
            try:
                api.call("POST", "/adapters/bulk", {"adapters": part})
            except click.ClickException as error:
                raise click.ClickException(f"{error.message} (entries {start + 1}-{start + len(part)}; "
                                           f"the {done} before them are registered)") from None
            done += len(part)
            bar.update(len(part))
    click.echo(f"Registered {done} adapters.")


def _adapter_entries(text: str, source: str) -> list[dict[str, Any]]:
    """Adapter objects from a JSON array or JSON lines, checked for the fields every entry needs."""
    stripped = text.strip()
    if not stripped:
        raise click.UsageError(f"{source} is empty")
    try:
        if stripped.startswith("["):
            entries = json.loads(stripped)
        else:
            entries = [json.loads(line) for line in stripped.splitlines() if line.strip()]
    except json.JSONDecodeError as error:
        raise click.UsageError(f"{source} is neither a JSON array nor JSON lines: {error}") from None
    for number, entry in enumerate(entries, 1):
        if not isinstance(entry, dict):
            raise click.UsageError(f"{source}, entry {number}: an adapter must be a JSON object")
        missing = [field for field in ("name", "version", "path") if not entry.get(field)]
        if missing:
            raise click.UsageError(f"{source}, entry {number}: missing {', '.join(missing)}")
    return entries


@adapters.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the adapters as JSON.")
@admin_options
def adapters_list(url: str | None, admin_key: str, as_json: bool) -> None:
    """List registered adapters: name, pinned version, a canary's candidate version, path and owner."""
    found = AdminAPI(url, admin_key).call("GET", "/adapters")["data"]
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    if not found:
        click.echo("No adapters. Register one with: inferbus adapters register NAME --version sha256:... --path ...")
        return
    rows = [[a["name"], a["version"][:19] + "…",
             (a.get("candidate_version") or "-")[:19] + ("…" if a.get("candidate_version") else ""),
             a["path"], a.get("owner") or "-", when(a["created"])] for a in found]
    click.echo(table(["NAME", "VERSION", "CANDIDATE", "PATH", "OWNER", "REGISTERED"], rows))


@adapters.command("remove")
@click.argument("name")
@admin_options
def adapters_remove(name: str, url: str | None, admin_key: str) -> None:
    """Unregister adapter NAME: requests for it get 404 at once (engines that loaded it keep it until they evict it)."""
    AdminAPI(url, admin_key).call("DELETE", f"/adapters/{quote(name)}")
    click.echo(f"Removed adapter {name}.")
