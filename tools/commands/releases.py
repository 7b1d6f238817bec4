"""`inferbus release …` and `inferbus eval`: create releases, run canaries, read where they stand.

These talk to NATS as the operator (NATS_URL, or the local platform `inferbus up` runs, with the
`ops` identity it generated), except `eval`, which is a client of the gateway like any other
(a tenant API key) and only writes its verdict to the bus.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click
import msgspec

from inferbus.releases import canary, eval_gate, record, split, store
from inferbus.stores import adapters as registry
from proto import messages as m
from proto import subjects

T = TypeVar("T")


def _run(nats_url: str | None, work: Callable[[Any, Any], Awaitable[T]]) -> T:
    from inferbus.runtime import logs
    from tools.commands import local_platform

    logs.configure("inferbus-cli", "error")  # JSON logs on stderr, and only when something is wrong
    chosen = local_platform.nats_url(nats_url)
    click.echo(chosen.note, err=True)

    async def main() -> T:
        nc = await local_platform.connect_bus(chosen.value, "inferbus-release")
        try:
            kv = await store.bucket(nc.jetstream())
            return await work(nc, kv)
        finally:
            await nc.drain()

    try:
        return asyncio.run(main())
    except (LookupError, ValueError, store.Conflict, registry.Conflict) as error:
        raise click.ClickException(str(error)) from None


def _nats_option(command: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--nats-url", envvar="NATS_URL", default=None,
                        help="NATS server with operator credentials (env NATS_URL). Default: the local platform "
                             "`inferbus up` runs (INFERBUS_PLATFORM_DIR), else nats://127.0.0.1:4222.")(command)


def _share(text: str) -> float:
    """`5%` or `0.05`."""
    text = text.strip()
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a share (such as 5% or 0.05)") from None
    if not 0 < value <= 1:
        raise click.BadParameter(f"{text!r} is not a share between 0 and 100%")
    return value


def _duration(text: str) -> float:
    text = text.strip()
    units = {"s": 1, "m": 60, "h": 3600}
    if text and text[-1] in units:
        return float(text[:-1]) * units[text[-1]]
    return float(text)


async def _publish(nc: Any, decision: m.ReleaseDecision) -> None:
    await nc.publish(subjects.release_subject(decision.adapter or decision.model), m.encode(decision))


def _describe(rollout: m.Rollout) -> list[str]:
    what = f"adapter {rollout.adapter} (of {rollout.model})" if rollout.adapter else rollout.model
    lines = [f"{what}: {rollout.state}", f"  stable     {record.short(rollout.stable)}"]
    if rollout.candidate:
        lines.append(f"  candidate  {record.short(rollout.candidate)}  share {rollout.share:.0%}"
                     f"  steps {' → '.join(f'{s:.0%}' for s in rollout.steps)}  sticky per {rollout.sticky}"
                     f"  window {rollout.window_s:g} s")
    if rollout.eval_suite:
        lines.append(f"  eval gate  suite {rollout.eval_suite}: {rollout.eval_verdict or 'not run yet'}"
                     + (f" ({rollout.eval_reason})" if rollout.eval_reason else ""))
    lines.append(
        f"  since      {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(rollout.updated))} UTC: {rollout.reason}"
    )
    return lines


@click.group()
def release() -> None:
    """Releases of a model (pinned checkpoint, template, engine build and flags, adapters) and
    canaries between them: see docs/releases.md."""


@release.command("create")
@click.option("--model", required=True, help="The served model name (what clients put in `model`).")
@click.option("--model-dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="The model directory the engines load: every file in it is hashed into the release.")
@click.option("--repo", required=True, help="The checkpoint's repository id on its hub.")
@click.option(
    "--revision", required=True, help="The checkpoint's full commit id (40 hex); branches and tags are refused."
)
@click.option("--engine-image", required=True, help="The engine build, pinned by digest: <image>@sha256:<64 hex>.")
@click.option("--flag", "flags", multiple=True, metavar="NAME=VALUE",
              help=f"An engine flag that changes answers, as the engine reports it in /server_info (repeatable): "
                   f"{', '.join(record.BEHAVIOUR_FLAGS)}.")
@click.option(
    "--adapter", "adapters", multiple=True, metavar="NAME=sha256:HEX", help="An adapter and its digest (repeatable)."
)
@click.option("--note", default="", help="Free text kept with the record (not part of its id).")
@_nats_option
def release_create(model: str, model_dir: str, repo: str, revision: str, engine_image: str, flags: tuple[str, ...],
                   adapters: tuple[str, ...], note: str, nats_url: str | None) -> None:
    """Hash MODEL_DIR into an immutable release record and store it in the `models` bucket.
    Prints its id; workers started with INFERBUS_WORKER_RELEASE=<id> verify they serve exactly it."""
    try:
        parsed_flags = dict(flag.split("=", 1) for flag in flags)
        parsed_adapters = [m.ReleaseAdapter(name=name, digest=digest)
                           for name, digest in (adapter.split("=", 1) for adapter in adapters)]
        built = record.build_release(
            model,
            model_dir,
            repo=repo,
            revision=revision,
            engine_image=engine_image,
            engine_flags=parsed_flags,
            adapters=parsed_adapters,
            created=time.time(),
            note=note,
        )
    except (ValueError, record.InvalidRelease) as error:
        raise click.ClickException(str(error)) from None

    async def work(nc: Any, kv: Any) -> bool:
        return await store.put_release(kv, built)

    created = _run(nats_url, work)
    click.echo(built.id)
    click.echo(f"{'Created' if created else 'Already there (same content)'}: release {record.short(built.id)} of "
               f"{model}, {len(built.files)} files, {sum(f.size for f in built.files):,} bytes.", err=True)


@release.command("digest")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
def release_digest(directory: str) -> None:
    """Print the digest of DIRECTORY's files (sha256 over each file's path and sha256): the version
    to register a LoRA adapter with (`inferbus adapters register NAME --version ...`), which
    workers check the adapter's files against on every load."""
    try:
        click.echo(record.directory_digest(directory))
    except record.InvalidRelease as error:
        raise click.ClickException(str(error)) from None


@release.command("list")
@click.option("--model", default=None, help="Only this model's releases.")
@_nats_option
def release_list(model: str | None, nats_url: str | None) -> None:
    """Every release, oldest first."""
    found = _run(nats_url, lambda nc, kv: store.releases(kv))
    for item in found:
        if model is None or item.model == model:
            click.echo(f"{record.short(item.id)}  {item.model}  {item.repo}@{item.revision[:12]}  "
                       f"{item.engine_image.rsplit('@', 1)[0]}  "
                       f"{','.join(f'{k}={v}' for k, v in item.engine_flags.items())}"
                       f"  {item.note}")


@release.command("show")
@click.argument("reference")
@_nats_option
def release_show(reference: str, nats_url: str | None) -> None:
    """One release record as JSON (REFERENCE: its id or a unique prefix)."""
    found = _run(nats_url, lambda nc, kv: store.resolve(kv, reference))
    click.echo(json.dumps(msgspec.to_builtins(msgspec.structs.asdict(found)), indent=2))


@release.command("stable")
@click.argument("reference")
@_nats_option
def release_stable(reference: str, nats_url: str | None) -> None:
    """Make REFERENCE its model's stable release, ending any canary (the first release of a model,
    or an operator's override). Requests are split by release from then on."""

    async def work(nc: Any, kv: Any) -> m.Rollout:
        chosen = await store.resolve(kv, reference)
        current, revision = await store.get_rollout(kv, chosen.model)
        now = time.time()
        rollout = m.Rollout(model=chosen.model, stable=chosen.id, state="stable", updated=now, started=now,
                            reason="set stable by an operator")
        await store.put_rollout(kv, rollout, revision)
        await _publish(nc, m.ReleaseDecision(model=chosen.model, ts=now, action="promote",
                                             stable=current.stable if current else chosen.id, candidate=chosen.id,
                                             share_before=current.share if current else 0.0, share_after=1.0,
                                             reason=rollout.reason, controller="operator"))
        return rollout

    click.echo("\n".join(_describe(_run(nats_url, work))))


@release.command("canary")
@click.argument("reference")
@click.option("--traffic", default="1%", show_default=True, help="The candidate's first share of the model's traffic.")
@click.option(
    "--steps",
    default=None,
    help="Shares after it, comma-separated, the last 100% (default: those of 1%, 5%, 25%, 100% above --traffic).",
)
@click.option("--sticky", type=click.Choice(["tenant", "prefix"]), default="tenant", show_default=True,
              help="What keeps a client on one side: its tenant, or its conversation's first prefix block.")
@click.option(
    "--window",
    default="5m",
    show_default=True,
    help="How long each step is observed before it may advance (e.g. 300s, 5m).",
)
@click.option(
    "--eval-suite",
    default=None,
    help="Also require this eval suite to pass (`inferbus eval SUITE --release ...`) before advancing.",
)
@_nats_option
def release_canary(reference: str, traffic: str, steps: str | None, sticky: str, window: str, eval_suite: str | None,
                   nats_url: str | None) -> None:
    """Send a share of a model's traffic to the candidate release REFERENCE; the router's canary
    controller advances it step by step while the SLO gate (and the eval gate, with --eval-suite)
    pass, promotes it at 100% and rolls it back by itself when a gate fails."""
    first = _share(traffic)
    if first >= 1:
        raise click.BadParameter("the first share must be below 100%", param_hint="--traffic")
    plan = [first, *(_share(s) for s in steps.split(","))] if steps else None
    if eval_suite is not None:
        try:
            eval_gate.load_suite(eval_suite)
        except eval_gate.SuiteError as error:
            raise click.ClickException(str(error)) from None

    async def work(nc: Any, kv: Any) -> m.Rollout:
        candidate = await store.resolve(kv, reference)
        current, revision = await store.get_rollout(kv, candidate.model)
        if current is None:
            raise LookupError(f"{candidate.model} has no stable release yet: `inferbus release stable <release>` first")
        if current.state == "canary":
            raise ValueError(f"{candidate.model} has a canary running ({record.short(current.candidate or '')}): "
                             "roll it back or let it finish first")
        now = time.time()
        rollout = canary.start(current.stable, candidate.id, candidate.model, first, now, sticky=sticky,
                               window_s=_duration(window), eval_suite=eval_suite, steps=plan)
        await store.put_rollout(kv, rollout, revision)
        await _publish(nc, m.ReleaseDecision(model=candidate.model, ts=now, action="start", stable=current.stable,
                                             candidate=candidate.id, share_before=0.0, share_after=rollout.share,
                                             reason=rollout.reason, controller="operator"))
        return rollout

    click.echo("\n".join(_describe(_run(nats_url, work))))


@release.command("adapter-canary")
@click.argument("adapter")
@click.option(
    "--path",
    required=True,
    help="Where engines load the new version from (a local directory is hashed here, "
    "and by every worker on every load).",
)
@click.option("--version", "version", default=None,
              help="The new version's digest, sha256:<64 hex> (`inferbus release digest DIR`; default: the digest of "
                   "--path, which must then be a local directory). Given with a local --path, they must agree.")
@click.option(
    "--traffic", default="5%", show_default=True, help="The new version's first share of the adapter's requests."
)
@click.option(
    "--steps",
    default=None,
    help="Shares after it, comma-separated, the last 100% (default: those of 1%, 5%, 25%, 100% above --traffic).",
)
@click.option("--sticky", type=click.Choice(["prefix", "tenant"]), default="prefix", show_default=True,
              help="What keeps a conversation on one version: its first prefix block, or (all on one side) its tenant.")
@click.option("--window", default="5m", show_default=True, help="How long each step is observed before it may advance.")
@click.option("--eval-suite", default=None,
              help="Also require this eval suite to pass (`inferbus eval SUITE --model ADAPTER --release VERSION`).")
@_nats_option
def release_adapter_canary(adapter: str, path: str, version: str | None, traffic: str, steps: str | None, sticky: str,
                           window: str, eval_suite: str | None, nats_url: str | None) -> None:
    """Canary a new version of LoRA adapter ADAPTER within its own requests: the version is
    registered as the adapter's candidate, a sticky share of the adapter's requests (per
    conversation, by default) runs on it, and the router's canary controller advances, promotes
    (the version becomes the registered one) or rolls it back on the SLO gate, measured per
    adapter version, and the eval gate. The base model and other adapters are not touched."""
    import os

    first = _share(traffic)
    if first >= 1:
        raise click.BadParameter("the first share must be below 100%", param_hint="--traffic")
    plan = [first, *(_share(s) for s in steps.split(","))] if steps else None
    if os.path.isdir(path):
        try:
            digest = record.directory_digest(path)
        except record.InvalidRelease as error:
            raise click.ClickException(str(error)) from None
        if version is not None and version != digest:
            raise click.ClickException(f"the files at {path} hash to {digest}, not --version {version}")
        version = digest
    elif version is None:
        raise click.BadParameter("give the version's digest: --path is not a local directory to hash",
                                 param_hint="--version")
    if not registry.DIGEST.match(version):
        raise click.BadParameter(f"{version!r} is not sha256:<64 hex digits>", param_hint="--version")
    if eval_suite is not None:
        try:
            eval_gate.load_suite(eval_suite)
        except eval_gate.SuiteError as error:
            raise click.ClickException(str(error)) from None
    assert version is not None
    chosen: str = version

    async def work(nc: Any, kv: Any) -> m.Rollout:
        adapters_kv = await registry.bucket(nc.jetstream())
        spec, spec_revision = await registry.get_with_revision(adapters_kv, adapter)
        if spec is None:
            raise LookupError(f"no adapter {adapter} is registered: `inferbus adapters register` its first version")
        if spec.version == chosen:
            raise ValueError(f"{chosen} is the registered version of {adapter} already")
        current, revision = await store.get_adapter_rollout(kv, spec.base_model, adapter)
        if current is not None and current.state == "canary":
            raise ValueError(f"adapter {adapter} has a canary running ({record.short(current.candidate or '')}): "
                             f"roll it back (`inferbus release rollback {adapter} --adapter`) or let it finish first")
        now = time.time()
        rollout = canary.start(spec.version, chosen, spec.base_model, first, now, sticky=sticky,
                               window_s=_duration(window), eval_suite=eval_suite, steps=plan, adapter=adapter)
        # The candidate's files first, then the share: a gateway never splits towards a version
        # it has no path for.
        await registry.update(adapters_kv, msgspec.structs.replace(spec, candidate_version=chosen, candidate_path=path),
                              spec_revision)
        await store.put_rollout(kv, rollout, revision)
        await _publish(nc, m.ReleaseDecision(model=spec.base_model, ts=now, action="start", stable=spec.version,
                                             candidate=chosen, share_before=0.0, share_after=rollout.share,
                                             reason=rollout.reason, controller="operator", adapter=adapter))
        return rollout

    click.echo("\n".join(_describe(_run(nats_url, work))))


@release.command("rollback")
@click.argument("model")
@click.option("--reason", default="rolled back by an operator", show_default=True)
@click.option("--adapter", "is_adapter", is_flag=True, help="MODEL is a LoRA adapter's name: end its canary.")
@_nats_option
def release_rollback(model: str, reason: str, is_adapter: bool, nats_url: str | None) -> None:
    """End MODEL's canary now: the stable release (or with --adapter, the adapter's stable
    version) takes all its traffic back."""

    async def work(nc: Any, kv: Any) -> m.Rollout:
        if is_adapter:
            spec = await registry.get(await registry.bucket(nc.jetstream()), model)
            if spec is None:
                raise LookupError(f"no adapter {model} is registered")
            current, revision = await store.get_adapter_rollout(kv, spec.base_model, model)
        else:
            current, revision = await store.get_rollout(kv, model)
        if current is None or current.state != "canary":
            raise LookupError(f"{model} has no canary running")
        now = time.time()
        rolled = canary.rollback(current, now, reason)
        await store.put_rollout(kv, rolled, revision)
        if rolled.adapter and not await store.settle_adapter(nc.jetstream(), rolled):
            click.echo(f"The registration of adapter {model} kept changing: its candidate is still registered.",
                       err=True)
        await _publish(nc, m.ReleaseDecision(model=current.model, ts=now, action="rollback", stable=current.stable,
                                             candidate=current.candidate, share_before=current.share, share_after=0.0,
                                             reason=reason, controller="operator", adapter=current.adapter))
        return rolled

    click.echo("\n".join(_describe(_run(nats_url, work))))


@release.command("status")
@click.option("--model", default=None, help="Only this model (and its adapters' canaries), or only this adapter.")
@click.option("--history", is_flag=True, help="Every state the model's rollout went through (the bucket keeps 64).")
@click.option("--json", "as_json", is_flag=True, help="As JSON.")
@_nats_option
def release_status(model: str | None, history: bool, as_json: bool, nats_url: str | None) -> None:
    """Where each model stands: its stable release, a canary's candidate, share, gates and why;
    then each adapter that had a canary: its stable and candidate versions, the same way."""

    async def work(nc: Any, kv: Any) -> list[list[m.Rollout]]:
        from inferbus.releases.follow import Rollouts

        current = Rollouts()
        await current.start(nc.jetstream())
        try:
            await asyncio.wait_for(current.loaded.wait(), 10)
        finally:
            await current.stop()
        found = []
        for name, rollout in sorted(current.by_model.items()):
            if model is None or name == model:
                found.append(await store.rollout_history(kv, name) if history else [rollout])
        for name, rollout in sorted(current.by_adapter.items()):
            if model is None or name == model or rollout.model == model:
                found.append(await store.rollout_history(kv, rollout.model, name) if history else [rollout])
        return found

    found = _run(nats_url, work)
    if as_json:
        # Every field, defaults included (the wire encoding leaves them out).
        click.echo(json.dumps([[msgspec.to_builtins(msgspec.structs.asdict(r)) for r in states] for states in found],
                              indent=2))
        return
    if not found:
        click.echo("No model has a release yet (`inferbus release create`, then `inferbus release stable`).")
    for states in found:
        for rollout in states:
            click.echo("\n".join(_describe(rollout)))


def _eval(suite: str, release_ref: str, baseline: str | None, model: str | None, repeats: int | None,
          concurrency: int, url: str | None, api_key: str, record_verdict: bool, nats_url: str | None) -> None:
    from tools.commands import local_platform

    try:
        loaded = eval_gate.load_suite(suite)
    except eval_gate.SuiteError as error:
        raise click.ClickException(str(error)) from None
    gateway_url, _, note = local_platform.gateway(url, "")
    if note:
        click.echo(note, err=True)

    async def resolve(nc: Any, kv: Any) -> tuple[str, str, str, m.AdapterSpec | None]:
        """(candidate, baseline, served model, the adapter when --model names one)."""
        spec = await registry.get(await registry.bucket(nc.jetstream()), model) if model else None
        if spec is not None:
            # An adapter's versions: the pin names a version of the adapter, not a release.
            version = split.match_adapter_pin(spec, release_ref)
            if version is None:
                raise LookupError(f"{release_ref} is not a registered version of adapter {spec.name} "
                                  f"(registered: {spec.version}, candidate: {spec.candidate_version or 'none'})")
            base_version = split.match_adapter_pin(spec, baseline) if baseline else spec.version
            if base_version is None or base_version == version:
                raise LookupError(f"adapter {spec.name} has no other version to compare {record.short(version)} with")
            return version, base_version, spec.name, spec
        candidate = await store.resolve(kv, release_ref)
        rollout, _ = await store.get_rollout(kv, model or candidate.model)
        base = (await store.resolve(kv, baseline)).id if baseline else rollout.stable if rollout else None
        if base is None:
            raise LookupError(f"{candidate.model} has no stable release to compare with: give --baseline")
        return candidate.id, base, model or candidate.model, None

    candidate_id, base, served, adapter = _run(nats_url, resolve)
    rounds = repeats or loaded.repeats
    scores = asyncio.run(_score_both(gateway_url, api_key, served, loaded, rounds, concurrency, [candidate_id, base]))
    cand_score, base_score = scores[candidate_id], scores[base]
    verdict = eval_gate.compare(cand_score.passed, cand_score.graded, base_score.passed, base_score.graded,
                                loaded.threshold, loaded.name)
    click.echo(f"{verdict.outcome.upper()}: {verdict.reason}")
    for item_id, answer in cand_score.failures:
        click.echo(f"  candidate wrong on {item_id}: {answer[:80]!r}", err=True)
    if record_verdict:
        async def write(nc: Any, kv: Any) -> str:
            for _ in range(5):
                rollout, revision = (await store.get_adapter_rollout(kv, adapter.base_model, adapter.name) if adapter
                                     else await store.get_rollout(kv, served))
                if rollout is None or rollout.state != "canary" or rollout.candidate != candidate_id:
                    return "not recorded: the release is not the model's running canary"
                updated = msgspec.structs.replace(rollout, eval_suite=rollout.eval_suite or loaded.name,
                                                  eval_verdict=verdict.outcome, eval_reason=verdict.reason)
                try:
                    await store.put_rollout(kv, updated, revision)
                except store.Conflict:
                    continue
                await _publish(nc, m.ReleaseDecision(
                    model=rollout.model, ts=time.time(), action="eval", stable=rollout.stable, candidate=candidate_id,
                    share_before=rollout.share, share_after=rollout.share, reason=verdict.reason, controller="eval",
                    adapter=rollout.adapter,
                    slo={"candidate_score": verdict.candidate_score, "baseline_score": verdict.baseline_score,
                         "difference_low": verdict.low, "difference_high": verdict.high}))
                return "recorded in the canary's eval gate"
            return "not recorded: the canary kept changing"

        click.echo(_run(nats_url, write), err=True)
    raise SystemExit({"pass": 0, "fail": 1, "inconclusive": 2}[verdict.outcome])


async def _score_both(gateway_url: str, api_key: str, model: str, suite: eval_gate.Suite, rounds: int,
                      concurrency: int, releases: list[str]) -> dict[str, eval_gate.Score]:
    import httpx

    scores = {release: eval_gate.Score() for release in releases}
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=gateway_url.rstrip("/") + "/v1", timeout=120,
                                 headers={"authorization": f"Bearer {api_key}"}) as client:

        async def one(release: str, item: eval_gate.Item, seed: int) -> None:
            body: dict[str, Any] = {"model": model, "max_tokens": item.max_tokens, "temperature": suite.temperature,
                                    "seed": seed}
            if item.response_format is not None:
                body["response_format"] = item.response_format
            if item.messages is not None:
                body["messages"] = item.messages
                path = "/chat/completions"
            else:
                body["prompt"] = item.prompt
                path = "/completions"
            async with limit:
                for _attempt in range(5):
                    response = await client.post(path, json=body, headers={"inferbus-release": release})
                    if response.status_code not in (429, 503):
                        break
                    await asyncio.sleep(float(response.headers.get("retry-after", "1")))
            if response.status_code != 200:
                raise click.ClickException(f"the gateway answered {response.status_code}: {response.text[:300]}")
            data = response.json()
            choice = data["choices"][0]
            answer = choice["message"]["content"] if "message" in choice else choice["text"]
            scores[release].add(item, answer or "")

        await asyncio.gather(*(one(release, item, r * 100_003 + i) for release in releases
                               for r in range(rounds) for i, item in enumerate(suite.items)))
    return scores


@click.command("eval")
@click.argument("suite")
@click.option("--release", "release_ref", required=True,
              help="The release to evaluate (its id, or 8+ hex of it); with --model ADAPTER, a version of the adapter.")
@click.option("--baseline", default=None,
              help="The release (or adapter version) to compare with (default: the model's stable release, or the "
                   "adapter's registered version).")
@click.option("--model", default=None,
              help="The served model (default: the release's), or a LoRA adapter: its versions are compared then.")
@click.option(
    "--repeats", default=None, type=click.IntRange(min=1), help="Runs of the suite per release (default: the suite's)."
)
@click.option("--concurrency", default=16, show_default=True, type=click.IntRange(min=1), help="Requests in flight.")
@click.option(
    "--url",
    envvar="INFERBUS_URL",
    default=None,
    help="Gateway base URL without /v1 (env INFERBUS_URL; default: the local platform's).",
)
@click.option("--api-key", envvar="INFERBUS_API_KEY", required=True, help="A tenant API key (env INFERBUS_API_KEY).")
@click.option("--record/--no-record", "record_verdict", default=True, show_default=True,
              help="Write the verdict into the model's canary (its eval gate) when the release is its candidate.")
@_nats_option
def eval_cli(suite: str, release_ref: str, baseline: str | None, model: str | None, repeats: int | None,
             concurrency: int, url: str | None, api_key: str, record_verdict: bool, nats_url: str | None) -> None:
    """Run eval SUITE (a JSONL file, or a suite shipped with inferbus: arithmetic) through the
    gateway pinned to a release and to its baseline, grade every answer, and compare the scores
    with a 95% confidence interval. Exit status 0: pass, 1: worse beyond the suite's threshold,
    2: inconclusive (run more --repeats). With --record, a canary's eval gate takes the verdict."""
    _eval(suite, release_ref, baseline, model, repeats, concurrency, url, api_key, record_verdict, nats_url)


def register(main: click.Group) -> None:
    main.add_command(release)
    main.add_command(eval_cli)
