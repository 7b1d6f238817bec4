"""Local processes: each replica is a simulated engine plus a worker, started as `inferbus up`
starts them (`inferbus.local.replicas.replica_processes`), with a simulated cold start, in standby (warm):
the autoscaler promotes it when it should serve. For `inferbus up --autoscale`, so a person can
watch a fleet grow and shrink on one machine.

It runs one or more pools, each of one role: an aggregated pool, or a disaggregated fleet's
prefill pool and decode pool (`inferbus up --prefill N --decode M --autoscale`), whose replicas are
prefill or decode engine+worker pairs. Worker ids are numbered across pools, so they stay unique."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from inferbus.local.process import Process
from inferbus.local.replicas import EngineSpec, replica_processes
from inferbus.runtime import logs
from inferbus.zones import zone_to_add, zone_to_remove

from .base import Actuator, FleetState, PoolFleet

log = logs.get(__name__)


@dataclass
class _Replica:
    engine: Process
    worker: Process


class LocalActuator(Actuator):
    name = "local"

    def __init__(self, pools: dict[str, str], spec: EngineSpec, logs_dir: Path, *, cold_start_s: float,
                 warm_start_s: float, drain_timeout_s: float = 30.0, env: dict[str, str] | None = None,
                 zones: Sequence[str] = ()) -> None:
        """`pools`: pool name → the role of its replicas (aggregated, prefill or decode)."""
        super().__init__()
        if not pools:
            raise ValueError("the local actuator needs a pool to run")
        self.pools = dict(pools)
        self.spec = spec
        self.logs_dir = logs_dir
        self.cold_start_s = cold_start_s
        self.warm_start_s = warm_start_s
        self.drain_timeout_s = drain_timeout_s
        self.env = dict(os.environ if env is None else env)
        self.replicas: dict[str, _Replica] = {}  # worker id → its processes, in start order
        self.pool_of: dict[str, str] = {}  # worker id → its pool
        self._retiring: set[asyncio.Task[None]] = set()
        self._next = 1
        self.zones = list(zones)  # replicas kept spread over these (inferbus.zones: N+1 per zone)
        self.zone_of: dict[str, str] = {}  # worker id → its zone

    def of_pool(self, pool: str) -> list[str]:
        """The pool's replicas (worker ids), in start order."""
        return [worker_id for worker_id in self.replicas if self.pool_of.get(worker_id) == pool]

    async def current(self) -> FleetState:
        self._reap()
        return FleetState({pool: PoolFleet(len(ids), tuple(ids)) for pool in self.pools
                           for ids in (self.of_pool(pool),)})

    async def scale(self, pool: str, replicas: int, retire: Sequence[str] = ()) -> None:
        if pool not in self.pools:
            raise ValueError(f"the local actuator runs {', '.join(map(repr, self.pools))}, not {pool!r}")
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        self._reap()
        while len(self.of_pool(pool)) < replicas:
            self._launch(pool)
        mine = self.of_pool(pool)
        excess = len(mine) - replicas
        for worker_id in self._spread_order(pool, [w for w in retire if w in mine], max(0, excess)):
            self._retire(worker_id, "scaled down")

    def _per_zone(self, pool: str) -> dict[str, int]:
        counts = dict.fromkeys(self.zones, 0)
        for worker_id in self.of_pool(pool):
            zone = self.zone_of.get(worker_id)
            if zone in counts:
                counts[zone] += 1
        return counts

    def _spread_order(self, pool: str, candidates: list[str], count: int) -> list[str]:
        """`count` of the policy's retire candidates; with zones, each from the pool's fullest zone
        that has one, so that what is left stays spread."""
        if not self.zones:
            return candidates[:count]
        chosen: list[str] = []
        counts = self._per_zone(pool)
        left = list(candidates)
        while left and len(chosen) < count:
            fullest = zone_to_remove({self.zone_of.get(w, ""): counts.get(self.zone_of.get(w, ""), 0) for w in left})
            pick = next(w for w in left if self.zone_of.get(w, "") == fullest)
            left.remove(pick)
            chosen.append(pick)
            counts[fullest] = counts.get(fullest, 0) - 1
        return chosen

    async def close(self) -> None:
        for worker_id in list(self.replicas):
            self._retire(worker_id, "autoscaler stopping")
        if self._retiring:
            await asyncio.wait(self._retiring)

    def _launch(self, pool: str) -> None:
        index = self._next
        self._next += 1
        role = self.pools[pool]
        zone = zone_to_add(self._per_zone(pool)) if self.zones else ""
        engine, worker = replica_processes(index, self.spec, self.env, self.logs_dir, worker_env={
            "INFERBUS_WORKER_STANDBY": "true",
            "INFERBUS_WORKER_SIM_COLD_START_S": str(self.cold_start_s),
            "INFERBUS_WORKER_SIM_WARM_START_S": str(self.warm_start_s),
            **({"INFERBUS_ZONE": zone} if zone else {}),
        }, role=role)
        engine.start()
        worker.start()
        worker_id = worker.env["INFERBUS_WORKER_ID"]
        self.replicas[worker_id] = _Replica(engine, worker)
        self.pool_of[worker_id] = pool
        if zone:
            self.zone_of[worker_id] = zone
        log.info(
            "replica_started",
            pool=pool,
            role=role,
            worker_id=worker_id,
            worker_pid=worker.pid,
            engine_pid=engine.pid,
            engine_url=engine.detail,
            cold_start_s=self.cold_start_s,
        )

    def _retire(self, worker_id: str, why: str) -> None:
        replica = self.replicas.pop(worker_id)
        self.zone_of.pop(worker_id, None)
        pool = self.pool_of.pop(worker_id, "")
        log.info("replica_stopping", pool=pool, worker_id=worker_id, worker_pid=replica.worker.pid, why=why)
        task = asyncio.ensure_future(self._stop(pool, worker_id, replica))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _stop(self, pool: str, worker_id: str, replica: _Replica) -> None:
        # The worker first (it drains and hands back what it holds), then its engine.
        for process, grace in ((replica.worker, self.drain_timeout_s + 10), (replica.engine, 5.0)):
            process.signal(signal.SIGTERM)
            if not await asyncio.to_thread(process.wait, grace):
                process.signal(signal.SIGKILL)
                await asyncio.to_thread(process.wait, 5)
        log.info("replica_stopped", pool=pool, worker_id=worker_id)

    def _reap(self) -> None:
        """A replica whose worker or engine died is gone: stop what is left of it."""
        for worker_id, replica in list(self.replicas.items()):
            if not replica.worker.alive() or not replica.engine.alive():
                log.warning("replica_exited", pool=self.pool_of.get(worker_id), worker_id=worker_id,
                            worker_alive=replica.worker.alive(), engine_alive=replica.engine.alive(),
                            tail=replica.worker.tail(5))
                self._retire(worker_id, "exited")
