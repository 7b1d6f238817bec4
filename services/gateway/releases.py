"""Which release serves each request: a canary's sticky split, or a client's pin.

The rollout of each model is followed from the `models` bucket; `inferbus.releases.split` decides.
A client (an eval run, an operator's smoke test) pins a request with the `Inferbus-Release`
header: the release, or 8+ hex of its id, must be the model's stable or candidate release, and a
worker of it must be up, else the request is refused (400 / 503) rather than served by another.

A LoRA adapter with a canary (two registered versions, and its rollout) is split the same way
within its own requests: the version chosen is part of the engine name the worker loads. For a
request of an adapter, the header pins a version of the adapter (its digest, or 8+ hex of it).
"""

from __future__ import annotations

from typing import NamedTuple

from nats.js import JetStreamContext

from inferbus.openai.errors import OpenAIError
from inferbus.releases import record, split
from inferbus.releases.follow import Rollouts
from proto import messages as m

from .dispatch import Dispatcher

PIN_HEADER = b"inferbus-release"


class AdapterChoice(NamedTuple):
    engine_name: str  # of the version that serves the request
    canary: bool = False  # the adapter has a canary: its latencies count per version
    pinned: bool = False  # the client pinned the version (an eval run)
    fallback: str | None = None  # on the candidate: the registered version, if the candidate cannot load


class ReleaseRouting:
    def __init__(self) -> None:
        self.rollouts = Rollouts()

    async def start(self, js: JetStreamContext) -> None:
        await self.rollouts.start(js)

    async def stop(self) -> None:
        await self.rollouts.stop()

    def assign(self, model: str, tenant: str, block_hashes: list[int], pin: str | None,
               dispatcher: Dispatcher) -> tuple[str | None, bool]:
        """(release, pinned) for a request; raises OpenAIError for a pin that cannot be honoured."""
        rollout = self.rollouts.get(model)
        if not pin:
            return split.assign(rollout, tenant, block_hashes), False
        release = split.match_pin(rollout, pin)
        if release is None:
            raise OpenAIError(400, f"Release {pin!r} is not serving `{model}`: pin the model's stable or candidate "
                                   "release (`inferbus release status`), by id or at least 8 hex digits of it.",
                              code="release_not_found")
        live = {beat.release for _, beat in dispatcher.live_workers.values()
                if beat.model == model and beat.state == "ready"}
        if release not in live:
            raise OpenAIError(503, f"No worker of release {record.short(release)} is serving `{model}` right now.",
                              code="release_unavailable", headers={"retry-after": "5"})
        return release, True

    def assign_adapter(self, spec: m.AdapterSpec, tenant: str, prompt_ids: list[int], block_size: int,
                       pin: str | None) -> AdapterChoice:
        """The version of adapter `spec` that serves a request; raises OpenAIError for a pin naming
        no version of it."""
        rollout = self.rollouts.adapter(spec.name)
        if pin:
            version = split.match_adapter_pin(spec, pin)
            if version is None:
                raise OpenAIError(400, f"Version {pin!r} is not a registered version of adapter `{spec.name}`: pin its "
                                       "version or its candidate's (`inferbus release status`), by digest or at least "
                                       "8 hex digits of it.", code="release_not_found")
            return AdapterChoice(m.adapter_engine_name(spec.name, version), pinned=True)  # an eval run
        if rollout is None:
            return AdapterChoice(spec.engine_name)
        key = split.adapter_sticky_key(rollout, tenant, prompt_ids, block_size)
        version = split.adapter_version(rollout, spec, key)
        in_canary = split.adapter_in_canary(rollout, spec)
        fallback = spec.engine_name if in_canary and version != spec.version else None
        return AdapterChoice(m.adapter_engine_name(spec.name, version), canary=in_canary, fallback=fallback)
