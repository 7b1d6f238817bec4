"""A decode worker's choices about the prefill half of a request it holds. Pure: no I/O.

The router names a prefill worker with the request (`InferenceRequest.prefill_worker`) when it
placed the pair; the decode worker uses that one unless it is gone or refuses. Otherwise it asks
the router (`PlacementRequest.role = "prefill"`), and when no router answers it chooses itself
from the prefill workers' heartbeats (`fallback`): in its own zone first, the fewest prefill
halves it has in flight there, ties at random. A prefill that fails before its KV reached the
decode engine is tried on another worker (`retry`), a bounded number of times.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from proto import messages as m

# Tries of one attempt's prefill (the first and the retries after a prefill worker refused, failed
# or died before its KV was sent). A full fleet refuses every try: then the request waits
# `FULL_BACKOFF_S` and asks again, within its deadline.
MAX_TRIES = 4
FULL_BACKOFF_S = 0.1


@dataclass(frozen=True)
class PrefillPeer:
    """A prefill worker as its heartbeat shows it."""

    worker_id: str
    model: str
    zone: str = ""
    ready: bool = True
    release: str = ""
    started: float = 0.0  # when its process started: another value is a restart, its halves lost

    @classmethod
    def of(cls, beat: m.Heartbeat) -> PrefillPeer:
        return cls(beat.worker_id, beat.model, beat.zone, beat.state == "ready", beat.release, beat.started)


def usable(peer: PrefillPeer | None, request: m.InferenceRequest, avoid: set[str]) -> bool:
    """Whether `peer` may compute `request`'s prompt: alive and ready, the request's model, not
    one that already refused or failed it, and of the request's release when it has one."""
    if peer is None or not peer.ready or peer.model != request.model or peer.worker_id in avoid:
        return False
    return not request.release or peer.release == request.release


def fallback(peers: list[PrefillPeer], request: m.InferenceRequest, zone: str, avoid: set[str],
             in_flight: dict[str, int], rng: random.Random) -> str | None:
    """A prefill worker chosen without the router: the decode worker's zone while it has one, the
    fewest of this decode worker's halves in flight, ties at random."""
    found = [peer for peer in peers if usable(peer, request, avoid)]
    if zone and any(peer.zone == zone for peer in found):
        found = [peer for peer in found if peer.zone == zone]
    if not found:
        return None
    fewest = min(in_flight.get(peer.worker_id, 0) for peer in found)
    return rng.choice(sorted(peer.worker_id for peer in found if in_flight.get(peer.worker_id, 0) == fewest))


def retry(*, code: str, got_first_token: bool, cancelled: bool, tries: int, now: float, deadline: float,
          batch: bool = False) -> bool:
    """Whether a failed prefill try is tried again on another worker. Only before the decode engine
    produced its first token: after it, the KV has arrived and the prefill side no longer matters.
    Not for a request the client cancelled, nor past its tries or deadline, nor for a refusal of
    the request itself (a 4xx: every engine would refuse it), nor for a batch line (`batch`) whose
    prefill gave way to interactive work (`preempted`): the line goes back to the batch queue as a
    preempted line does on any worker (`handed_back`), to run where there is spare capacity."""
    if got_first_token or cancelled or tries >= MAX_TRIES or now >= deadline:
        return False
    if handed_back(code=code, batch=batch):
        return False
    return code not in ("invalid_request",)


def handed_back(*, code: str, batch: bool) -> bool:
    """Whether a failed prefill try ends the attempt of a batch line, its line back on the batch
    queue: its prefill worker preempted the half for an interactive one."""
    return batch and code == "preempted"
