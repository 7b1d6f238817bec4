"""Placement policy: pure, with an injected clock and random source, so the service, tests and
the discrete-event simulator run the same code.

This is the serving spine's policy: hard filters (alive, not draining, KV below a ceiling), then
least load, counting the router's own recent placements because load reports lag by up to one
report interval. Prefix and adapter affinity extend `cost` (issue 4).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from proto import messages as m
from proto import subjects


@dataclass
class WorkerView:
    worker_id: str
    model: str
    last_seen: float
    max_running: int = 1
    draining: bool = False
    reported_load: int = 0  # running + waiting at the last report
    reported_at: float = 0.0
    kv_usage: float = 0.0
    placed_since_report: int = 0


@dataclass
class PlacementPolicy:
    clock: Callable[[], float]
    heartbeat_ttl_s: float = 3.0
    kv_ceiling: float = 0.95
    temperature: float = 0.05  # softmax over normalised load; small = nearly greedy
    rng: random.Random = field(default_factory=random.Random)
    workers: dict[str, WorkerView] = field(default_factory=dict)

    def on_heartbeat(self, beat: m.Heartbeat) -> None:
        view = self.workers.get(beat.worker_id)
        if view is None:
            view = self.workers[beat.worker_id] = WorkerView(beat.worker_id, beat.model, self.clock())
        view.last_seen = self.clock()
        view.max_running = max(1, beat.max_running)
        view.draining = beat.state == "draining"

    def on_worker_gone(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def on_load(self, load: m.WorkerLoad) -> None:
        view = self.workers.get(load.worker_id)
        if view is None:
            return
        view.reported_load = load.running + load.waiting
        view.reported_at = self.clock()
        view.placed_since_report = 0
        view.draining = load.draining
        view.kv_usage = load.kv_used_tokens / load.kv_capacity_tokens if load.kv_capacity_tokens else 0.0

    def alive(self, view: WorkerView) -> bool:
        return self.clock() - view.last_seen <= self.heartbeat_ttl_s

    def expire(self) -> list[str]:
        dead = [wid for wid, view in self.workers.items() if not self.alive(view)]
        for worker_id in dead:
            del self.workers[worker_id]
        return dead

    def place(self, request: m.PlacementRequest) -> m.PlacementReply:
        candidates = [
            view for view in self.workers.values()
            if view.model == request.model and self.alive(view) and not view.draining and view.kv_usage < self.kv_ceiling
        ]
        if not candidates:
            return m.PlacementReply(target=subjects.ANY_TARGET, reason="no eligible worker")
        costs = [(view.reported_load + view.placed_since_report) / view.max_running for view in candidates]
        best = min(costs)
        weights = [math.exp(-(cost - best) / self.temperature) for cost in costs]
        chosen = self.rng.choices(candidates, weights)[0]
        chosen.placed_since_report += 1
        return m.PlacementReply(target=subjects.worker_target(chosen.worker_id), worker_id=chosen.worker_id, reason="least_loaded")
