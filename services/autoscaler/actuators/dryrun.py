"""Dry run: decisions are published and logged, nothing is changed. For trying a policy on a live
fleet (its decisions are on `inferbus.scale.<pool>`) before letting it act."""

from __future__ import annotations

from collections.abc import Sequence

from inferbus.runtime import logs

from .base import Actuator, FleetState

log = logs.get(__name__)


class DryRunActuator(Actuator):
    name = "dryrun"

    def __init__(self) -> None:
        super().__init__()
        self.actions: list[tuple[str, str, object]] = []  # (action, pool, detail): what it would have done

    async def current(self) -> FleetState:
        return FleetState()  # the service then takes the fleet as the workers report it

    async def scale(self, pool: str, replicas: int, retire: Sequence[str] = ()) -> None:
        self.actions.append(("scale", pool, (replicas, tuple(retire))))
        log.info("dryrun_scale", pool=pool, replicas=replicas, retire=list(retire))

    async def promote(self, pool: str, worker_id: str) -> None:
        self.actions.append(("promote", pool, worker_id))
        log.info("dryrun_promote", pool=pool, worker_id=worker_id)

    async def demote(self, pool: str, worker_id: str) -> None:
        self.actions.append(("demote", pool, worker_id))
        log.info("dryrun_demote", pool=pool, worker_id=worker_id)
