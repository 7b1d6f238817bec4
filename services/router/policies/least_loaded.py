"""`least_loaded`: the fewest requests per slot, counting placements made since the last report
(reports lag by up to one interval), with a softmax over near-ties."""

from __future__ import annotations

from proto import messages as m

from ..registry import WorkerView
from .base import RegistryPolicy


class LeastLoadedPolicy(RegistryPolicy):
    name = "least_loaded"

    def load_cost(self, view: WorkerView, backlog: int) -> float | None:
        return (view.reported_load + backlog) / view.max_running

    def choose(self, request: m.PlacementRequest, candidates: list[WorkerView]) -> tuple[WorkerView, int]:
        costs = [(view.reported_load + view.backlog()) / view.max_running for view in candidates]
        return candidates[self._softmax_pick(costs)], 0
