"""The one interface every actuator implements.

An actuator owns *how many replicas run* (processes, pods); which of them serve is a worker-level
switch, sent over the bus as a `ControlCommand` (promote: warm → serving; demote: serving → warm,
after its in-flight work is done), the same for every actuator.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from proto import messages as m

SendControl = Callable[[str, m.ControlCommand], Awaitable[None]]


@dataclass(frozen=True)
class PoolFleet:
    replicas: int  # replicas the actuator runs for the pool (serving + warm + starting), not counting retiring ones
    ids: tuple[str, ...] = ()  # worker ids, where the actuator knows them (local: yes; Kubernetes: no)


@dataclass(frozen=True)
class FleetState:
    pools: dict[str, PoolFleet] = field(default_factory=dict)


class Actuator(abc.ABC):
    name = "base"

    def __init__(self, send_control: SendControl | None = None) -> None:
        self._send_control = send_control

    def bind(self, send_control: SendControl) -> None:
        """Give the actuator the bus (the service does, once connected)."""
        self._send_control = send_control

    async def start(self) -> None:  # noqa: B027 (an optional hook: most actuators hold nothing)
        """Connect to whatever it drives."""

    async def close(self) -> None:  # noqa: B027 (an optional hook)
        """Release what it holds (the local actuator stops the replicas it started)."""

    @abc.abstractmethod
    async def current(self) -> FleetState:
        """Replicas per pool as the actuator sees them; a pool it knows nothing of is absent."""

    @abc.abstractmethod
    async def scale(self, pool: str, replicas: int, retire: Sequence[str] = ()) -> None:
        """Run `replicas` replicas of `pool`. When that is fewer than now, stop the replicas named
        in `retire` (idle warm ones) first, where the actuator can choose."""

    async def promote(self, pool: str, worker_id: str) -> None:
        await self._control(worker_id, m.ControlCommand(action="promote"))

    async def demote(self, pool: str, worker_id: str) -> None:
        await self._control(worker_id, m.ControlCommand(action="demote"))

    async def _control(self, worker_id: str, command: m.ControlCommand) -> None:
        if self._send_control is None:
            raise RuntimeError(f"{self.name} actuator has no bus to send {command.action} to {worker_id}")
        await self._send_control(worker_id, command)
