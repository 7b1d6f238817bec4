"""What a placement policy is: a choice among the workers that pass the registry's filters."""

from __future__ import annotations

import abc
import math
import random
from typing import Protocol

from proto import messages as m

from ..config import RoutingConfig
from ..index import PrefixIndex
from ..registry import WorkerRegistry, WorkerView


class Policy(Protocol):
    name: str
    rng: random.Random  # the softmax's random source

    def choose(self, request: m.PlacementRequest, candidates: list[WorkerView]) -> tuple[WorkerView, int]:
        """The worker to place on (`candidates` is never empty), and how many of the request's
        prefix blocks it holds."""
        ...

    def load_cost(self, view: WorkerView, backlog: int) -> float | None:
        """The cost this policy ranks `view` by for a request that has nothing but its load to go
        on (`load_only`), given `view.backlog()`; None: the policy does not rank by a cost. A
        sampler that keeps these costs current (the fleet simulator's) draws what `choose` would."""
        ...

    def load_only(self, request: m.PlacementRequest) -> bool:
        """Whether `choose` sees only the workers' `load_cost` for this request (plus a constant
        the same for every worker)."""
        ...


class RegistryPolicy(abc.ABC):
    """Shared by the policies here: the registry they read and the random source of their
    softmax."""

    name = "base"

    def __init__(self, registry: WorkerRegistry, rng: random.Random | None = None) -> None:
        self.registry = registry
        self.rng = rng or random.Random()

    @property
    def config(self) -> RoutingConfig:
        return self.registry.config

    @property
    def index(self) -> PrefixIndex:
        return self.registry.index

    @abc.abstractmethod
    def choose(self, request: m.PlacementRequest, candidates: list[WorkerView]) -> tuple[WorkerView, int]: ...

    def load_cost(self, view: WorkerView, backlog: int) -> float | None:
        return None

    def load_only(self, request: m.PlacementRequest) -> bool:
        return not request.adapter

    def _softmax_pick(self, costs: list[float]) -> int:
        """An index drawn with weight exp(-(cost - best) / temperature); choices more than ten
        temperatures worse (weight < 5e-5) are left out, which keeps this cheap on big fleets."""
        best = min(costs)
        temperature = max(self.config.temperature, 1e-9)
        cutoff = best + 10 * temperature
        near = [i for i, cost in enumerate(costs) if cost <= cutoff]
        if len(near) == 1:
            return near[0]
        weights = [math.exp((best - costs[i]) / temperature) for i in near]
        return self.rng.choices(near, weights)[0]
