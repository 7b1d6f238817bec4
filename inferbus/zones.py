"""N+1 per zone: how a serving fleet is spread so that losing any one zone leaves enough. Pure.

With Z zones and `needed` replicas to serve the peak within the SLO (peak ÷ goodput × (1 +
headroom)), the fleet runs N serving replicas spread evenly, at most one apart between zones (Kubernetes: a
topology spread constraint with maxSkew 1 on `topology.kubernetes.io/zone`), with N the smallest
count for which losing the largest zone leaves enough: N − ⌈N ÷ Z⌉ ≥ ⌈needed⌉. That is about
needed × Z ÷ (Z − 1), rounded up in whole replicas per zone. The warm
pool is spread the same way, so that the replicas promoted after a zone loss start in the zones
that are left.
"""

from __future__ import annotations

import math


def spread(replicas: int, zones: int) -> list[int]:
    """`replicas` spread over `zones` as evenly as whole replicas allow (largest first)."""
    base, extra = divmod(replicas, zones)
    return [base + (1 if i < extra else 0) for i in range(zones)]


def left_after_zone_loss(per_zone: list[int]) -> int:
    """Replicas left when the zone holding the most is lost."""
    return sum(per_zone) - max(per_zone, default=0)


def survives_zone_loss(per_zone: list[int], needed: float) -> bool:
    return len(per_zone) > 1 and left_after_zone_loss(per_zone) >= math.ceil(needed - 1e-9)


def replicas_for_zone_loss(needed: float, zones: int) -> int:
    """The smallest fleet that, spread evenly over `zones`, keeps `needed` replicas after losing one."""
    if zones < 2:
        return math.ceil(needed - 1e-9)
    replicas = math.ceil(needed - 1e-9)
    while not survives_zone_loss(spread(replicas, zones), needed):
        replicas += 1
    return replicas


def zone_to_add(per_zone: dict[str, int]) -> str:
    """Where the next replica goes: the zone with the fewest (ties: the first by name)."""
    return min(sorted(per_zone), key=lambda zone: per_zone[zone])


def zone_to_remove(per_zone: dict[str, int]) -> str:
    """Which zone gives up a replica on scale-down: the one with the most (ties: the last by name)."""
    return max(sorted(per_zone, reverse=True), key=lambda zone: per_zone[zone])
