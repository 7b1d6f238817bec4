"""`inferbus mix from-usage`: the shell that reads a window of the usage ledger (tools/capacity/usage_mix.py)."""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import time
from pathlib import Path

import click
import msgspec
import yaml

from proto import messages as m
from proto import subjects
from tools.capacity import mix as mix_mod
from tools.capacity import usage_mix

_AGO = re.compile(r"^(?P<n>\d+(?:\.\d+)?)(?P<unit>[smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# Usage events are published when a request finishes, a little later if the outbox held them:
# read this far past the window's end before deciding nothing more belongs to it.
PUBLISH_SLACK_S = 300.0


def parse_when(text: str, now: float) -> float:
    """`2026-12-01T10:00Z`, unix seconds, or a span back from now: `90m`, `24h`, `7d`."""
    ago = _AGO.match(text.strip())
    if ago:
        return now - float(ago["n"]) * _UNIT_S[ago["unit"]]
    from services.gateway.usage_api import parse_time

    return parse_time(text)


async def read_ledger(nats_url: str, start: float, end: float) -> list[m.UsageEvent]:
    """Every usage event the USAGE stream stored from `start` until `end` (+ the publish slack)."""
    import nats
    from nats.js.api import ConsumerConfig, DeliverPolicy

    from tools.commands import local_platform

    # One read of a window: fail at once when the server is not there rather than reconnect.
    nc = await local_platform.connect_bus(nats_url, "mix-from-usage")
    events: list[m.UsageEvent] = []
    try:
        js = nc.jetstream()
        info = await js.stream_info(subjects.USAGE_STREAM)
        if info.state.messages == 0:
            return events
        since = dt.datetime.fromtimestamp(start, dt.timezone.utc)
        sub = await js.subscribe(
            subjects.usage_stream_subjects()[0], ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since),
        )
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=2.0)
                except nats.errors.TimeoutError:
                    break  # nothing stored after this point
                events.append(msgspec.msgpack.decode(msg.data, type=m.UsageEvent))
                stored = msg.metadata.timestamp.timestamp()
                if msg.metadata.num_pending == 0 or stored > end + PUBLISH_SLACK_S:
                    break
        finally:
            await sub.unsubscribe()
    finally:
        await nc.close()
    return events


@click.group("mix")
def mix_group() -> None:
    """Workload mixes: what requests look like, for `inferbus sweep`, `plan` and `simulate`."""


@mix_group.command("from-usage")
@click.option("--since", required=True,
              help="Start of the window: ISO 8601 (UTC unless an offset is given), unix seconds, or a span back "
                   "from now, e.g. 24h, 90m, 7d.")
@click.option("--until", "until", default=None, help="End of the window, in the same forms [default: now].")
@click.option("--model", default=None, help="Only this model's requests, e.g. meta-llama/Llama-3.3-70B-Instruct.")
@click.option("--tenant", default=None, help="Only this tenant's requests.")
@click.option("--include-batch", is_flag=True, help="Count Batch API lines too (left out by default: interactive "
                                                      "capacity is planned from interactive traffic).")
@click.option("--name", default=None, help="Name of the mix [default: usage-<start>-<end>].")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the mix spec here (YAML) instead of printing it, e.g. --out measured.yaml.")
@click.option("--nats-url", envvar="NATS_URL", default=None,
              help="NATS server holding the USAGE stream (env NATS_URL; credentials from NATS_USER/NATS_PASSWORD). "
                   "Default: the local platform `inferbus up` runs (with its operator credentials), else "
                   "nats://127.0.0.1:4222.")
def from_usage(since: str, until: str | None, model: str | None, tenant: str | None, include_batch: bool,
               name: str | None, out: Path | None, nats_url: str | None) -> None:
    """Turn a window of the platform's own traffic (the usage ledger) into a mix spec.

    Completed requests of the window are binned on a log2 grid of (input, output) tokens; each
    cell becomes a class with its request count as weight, its mean input and output tokens and
    its cached share of input tokens, so the next plan starts from measured tokens per request.

    \b
    Examples:
      inferbus mix from-usage --since 24h --out measured.yaml
      inferbus plan --rpm 50000 --mix measured.yaml
    """
    now = time.time()
    try:
        start = parse_when(since, now)
        end = parse_when(until, now) if until else now
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    if end <= start:
        raise click.BadParameter("the window is empty: --until must be after --since")
    window = usage_mix.UsageFilter(start=start, end=end, model=model, tenant=tenant, include_batch=include_batch)
    from tools.commands import local_platform

    ledger = local_platform.nats_url(nats_url)
    click.echo(ledger.note, err=True)
    try:
        events = asyncio.run(read_ledger(ledger.value, start, end))
    except click.ClickException:
        raise  # the server could not be reached: said already
    except Exception as error:  # the connection or the stream lookup: report, don't trace back
        raise click.ClickException(f"cannot read the usage ledger at {local_platform.redact(ledger.value)}: "
                                   f"{error or type(error).__name__}") from None
    collected = usage_mix.collect(events, window)

    def stamp(t: float) -> str:
        return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y%m%dT%H%MZ")

    try:
        spec = usage_mix.to_spec(collected, name or f"usage-{stamp(start)}-{stamp(end)}")
        mix = mix_mod.from_spec(spec, source="usage")
    except (ValueError, mix_mod.MixError) as error:
        raise click.ClickException(str(error)) from None
    stats = mix.stats()
    text = yaml.safe_dump(spec, sort_keys=False, allow_unicode=True)
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(collected.skipped.items())) or "none"
    summary = (
        f"{collected.counted:,} requests in {len(spec['classes'])} classes: mean input {stats.input_tokens:,.0f}, "
        f"output {stats.output_tokens:,.0f}, cached {stats.cached_tokens:,.0f} tokens (left out: {skipped})."
    )
    if out is None:
        click.echo(text, nl=False)
        click.echo(summary, err=True)
    else:
        out.write_text(text)
        click.echo(f"Wrote {out}: {summary}")

