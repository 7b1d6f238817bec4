"""Which release serves each request: a canary's sticky split, or a client's pin.

The rollout of each model is followed from the `models` bucket; `inferbus.releases.split` decides.
A client (an eval run, an operator's smoke test) pins a request with the `Inferbus-Release`
header: the release, or 8+ hex of its id, must be the model's stable or candidate release, and a
worker of it must be up, else the request is refused (400 / 503) rather than served by another.
"""

from __future__ import annotations

from nats.js import JetStreamContext

from inferbus.openai.errors import OpenAIError
from inferbus.releases import record, split
from inferbus.releases.follow import Rollouts

from .dispatch import Dispatcher

PIN_HEADER = b"inferbus-release"


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
