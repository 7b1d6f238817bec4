"""`round_robin`: the candidates in turn, by worker id (a baseline)."""

from __future__ import annotations

from proto import messages as m

from ..registry import WorkerView
from .base import RegistryPolicy


class RoundRobinPolicy(RegistryPolicy):
    name = "round_robin"
    _turn: int = 0

    def choose(self, request: m.PlacementRequest, candidates: list[WorkerView]) -> tuple[WorkerView, int]:
        candidates = sorted(candidates, key=lambda view: view.worker_id)
        self._turn = (self._turn + 1) % len(candidates)
        return candidates[self._turn], 0
