"""`inferbus drill KIND`: a failure drill against the platform `inferbus up` runs."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

import click

from tools.drill.run import KINDS


@click.command("drill")
@click.argument("kind", type=click.Choice(KINDS))
@click.option("--state-dir", default=None, envvar="INFERBUS_PLATFORM_DIR", show_envvar=True,
              type=click.Path(file_okay=False, exists=True),
              help="State dir of the running platform (`inferbus up --state-dir`). Default: .inferbus")
@click.option("--duration", "duration_s", default=30.0, show_default=True, type=click.FloatRange(min=5),
              help="Seconds of load, fault included.")
@click.option("--fault-at", "fault_at_s", default=5.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds into the load when the fault is made.")
@click.option("--clients", default=6, show_default=True, type=click.IntRange(1, 256),
              help="Concurrent clients, each sending one streamed chat completion after another.")
@click.option("--max-tokens", default=24, show_default=True, type=click.IntRange(1, 4096), help="Tokens per answer.")
@click.option(
    "--attempts",
    "max_attempts",
    default=4,
    show_default=True,
    type=click.IntRange(1, 10),
    help="Tries per request (the client's own retries, on the next gateway, after a connection error, 429 or 5xx).",
)
@click.option("--hang", "hang_s", default=8.0, show_default=True, type=click.FloatRange(min=0),
              help="worker-hang: seconds the worker stays stopped.")
@click.option("--recover-within", "recover_s", default=45.0, show_default=True, type=click.FloatRange(min=1),
              help="Seconds after the fault by which service must be restored for the drill to pass.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def drill(kind: str, state_dir: str | None, duration_s: float, fault_at_s: float, clients: int, max_tokens: int,
          max_attempts: int, hang_s: float, recover_s: float, as_json: bool) -> None:
    """Break one part of the running platform under a bounded load and report what it cost.

    KIND is what breaks: worker-kill (SIGKILL a worker), worker-hang (SIGSTOP it for --hang s),
    prefill-kill and decode-kill on a disaggregated platform (`inferbus up --prefill 2 --decode 2`:
    a prefill worker and its engine killed while it computes or sends a prompt's KV, a decode
    worker and its engine while it streams),
    gpu-death (its engine's GPU hangs: the worker must give it up and be replaced), router-kill,
    billing-kill, and on a multi-zone platform (`inferbus up --zones 3`) nats-node-kill, zone-loss
    (every process of the first zone at once: NATS node, sentinel, Redis primary, router, gateway,
    workers and engines) and redis-failover (the Redis primary; Sentinel promotes the replica).

    The report: requests sent, completed and failed by status after the clients' retries, the
    5xx ratio against the 0.1% budget, streams migrated, usage events lost, duplicated or with
    other tokens than the client was told (the USAGE ledger against what the clients received),
    and the time to recover. Exit status 1 when the drill fails one of them. Runbooks:
    docs/runbooks/.
    """
    from inferbus.local.stack import read_platform_file
    from tools.commands.local_platform import demo_key
    from tools.commands.local_platform import state_dir as default_state_dir
    from tools.drill import run as runner

    directory = Path(state_dir) if state_dir else default_state_dir()
    found = read_platform_file(directory)
    if found is None:
        raise click.UsageError(f"no platform runs from {directory}: start one with `inferbus up --zones 3`, "
                               "or give its --state-dir")
    key = asyncio.run(demo_key(str(found["redis_url"])))
    report = runner.run(kind, directory, api_key=key, duration_s=duration_s, fault_at_s=fault_at_s, clients=clients,
                        max_tokens=max_tokens, max_attempts=max_attempts, hang_s=hang_s,
                        say=lambda line: click.echo(line, err=as_json))
    if as_json:
        click.echo(json.dumps({**asdict(report), "within_budget": report.within_budget,
                               "ok": report.ok(recover_s)}, indent=2))
    else:
        click.echo("\n".join(report.lines()))
    sys.exit(0 if report.ok(recover_s) else 1)
