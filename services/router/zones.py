"""Zone preference: keep a request in the asking gateway's zone while that zone has room.

Pure. A request stays on the bus, the gateway and the worker of one zone when it can (no
cross-zone hop for its tokens, and a zone's loss takes only that zone's requests with it); when
every eligible worker of the zone is full, or the zone has none left (lost, drained), every
candidate is offered to the policy, which places by cost across zones. A request without a zone,
or a fleet without zones, is unaffected.
"""

from __future__ import annotations

from .registry import WorkerView


def has_room(view: WorkerView) -> bool:
    """Whether the worker has a free slot, counting what is placed on it and not yet pulled."""
    return view.reported_load + view.backlog() < view.max_running


def prefer_zone(candidates: list[WorkerView], zone: str) -> list[WorkerView]:
    """The candidates of `zone` if one of them has room, else all of them (spill across zones)."""
    if not zone:
        return candidates
    local = [view for view in candidates if view.zone == zone]
    if any(has_room(view) for view in local):
        return local
    return candidates
