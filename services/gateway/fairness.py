"""Weighted fair sharing of the fleet between tenants: a virtual token counter (VTC) fair queue.

Pure: no I/O, no clock. Under contention, requests wait here instead of in the shared JetStream
queue (which is first come, first served) and leave in fair order:

- bands strictly by importance (premium before standard);
- within a band, the tenant whose counter (tokens served ÷ weight) is lowest goes first, so a
  tenant sending ten times the traffic of another gets no more than its weighted share;
- a tenant that becomes active again is lifted to the lowest counter among active tenants, so
  being idle does not bank credit to burst with later (Sheng et al., "Fairness in Serving Large
  Language Models", OSDI 2024);
- nothing waits while there is room: the queue only holds what the window refuses.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from proto import bands

T = TypeVar("T")


@dataclass
class _Tenant(Generic[T]):
    counter: float = 0.0
    waiting: deque[T] = field(default_factory=deque)
    active: int = 0  # requests dispatched and not finished


class FairQueue(Generic[T]):
    def __init__(self) -> None:
        self._bands: dict[str, dict[str, _Tenant[T]]] = {band: {} for band in bands.BANDS}
        self._weights: dict[str, float] = {}
        self._size = 0
        self._waiting_by_band: dict[str, int] = {}

    def __len__(self) -> int:
        return self._size

    def waiting(self, band: str) -> int:
        """Items of `band` waiting (kept as a count: the gateway asks on every request)."""
        return self._waiting_by_band.get(band, 0)

    def _count(self, band: str, delta: int) -> None:
        self._size += delta
        self._waiting_by_band[band] = self._waiting_by_band.get(band, 0) + delta

    def _tenant(self, band: str, tenant: str) -> _Tenant[T]:
        tenants = self._bands.setdefault(band, {})
        state = tenants.get(tenant)
        if state is None:
            state = tenants[tenant] = _Tenant()
        return state

    def _lift(self, band: str, state: _Tenant[T]) -> None:
        if state.waiting or state.active:
            return  # already active: it keeps its own counter
        active = [t.counter for t in self._bands[band].values() if (t.waiting or t.active) and t is not state]
        if active:
            state.counter = max(state.counter, min(active))

    def push(self, item: T, tenant: str, band: str, weight: float) -> None:
        """Queue `item` until `pop` picks it."""
        self._weights[tenant] = max(weight, 1e-6)
        state = self._tenant(band, tenant)
        self._lift(band, state)
        state.waiting.append(item)
        self._count(band, +1)

    def dispatched(self, tenant: str, band: str, weight: float, tokens: float) -> None:
        """A request went out without waiting: it counts toward its tenant's share all the same."""
        self._weights[tenant] = max(weight, 1e-6)
        state = self._tenant(band, tenant)
        self._lift(band, state)
        state.active += 1
        state.counter += tokens / self._weights[tenant]

    def pop(self, cost: Callable[[T], float] = lambda item: 0.0) -> tuple[T, str, str] | None:
        """The next (item, tenant, band) to dispatch, charging its tenant `cost(item)` tokens."""
        for band in bands.BANDS:
            candidates = [
                (state.counter, tenant) for tenant, state in self._bands.get(band, {}).items() if state.waiting
            ]
            if not candidates:
                continue
            _, tenant = min(candidates)
            state = self._bands[band][tenant]
            item = state.waiting.popleft()
            self._count(band, -1)
            state.active += 1
            state.counter += cost(item) / self._weights[tenant]
            return item, tenant, band
        return None

    def remove(self, item: T, tenant: str, band: str) -> bool:
        """Take back a waiting item (its client left); False if it was not waiting."""
        state = self._bands.get(band, {}).get(tenant)
        if state is None or item not in state.waiting:
            return False
        state.waiting.remove(item)
        self._count(band, -1)
        return True

    def finished(self, tenant: str, band: str, estimated: float, actual: float) -> None:
        """A dispatched request ended: replace its estimated tokens with what it really used."""
        state = self._tenant(band, tenant)
        state.active = max(0, state.active - 1)
        state.counter += (actual - estimated) / self._weights.get(tenant, 1.0)

    def counters(self, band: str) -> dict[str, float]:
        return {tenant: state.counter for tenant, state in self._bands.get(band, {}).items()}
