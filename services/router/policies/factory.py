"""The policy named by the router's settings (`INFERBUS_ROUTER_POLICY`)."""

from __future__ import annotations

import random
from typing import Literal

from ..registry import WorkerRegistry
from .affinity import AffinityPolicy
from .base import Policy, RegistryPolicy
from .least_loaded import LeastLoadedPolicy
from .round_robin import RoundRobinPolicy

PolicyName = Literal["affinity", "least_loaded", "round_robin"]
POLICY_NAMES: tuple[PolicyName, ...] = ("affinity", "least_loaded", "round_robin")

_POLICIES: dict[str, type[RegistryPolicy]] = {
    "affinity": AffinityPolicy, "least_loaded": LeastLoadedPolicy, "round_robin": RoundRobinPolicy,
}


def make_policy(name: str, registry: WorkerRegistry, rng: random.Random | None = None) -> Policy:
    try:
        kind = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None
    return kind(registry, rng or random.Random())
