"""Where the gateway queues a request, pure: beside the first choice of an n-choice request,
whether the router is worth asking at all, whether its answer can be taken, and where a request
pinned to a release goes when it cannot (never the shared queue, which any release's worker
pulls). `fits(worker_id, band)`: the worker's own queue would start it within its band's budget."""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from typing import Literal

from proto import messages as m
from proto import subjects

from .flight import Flight

Fits = Callable[[str, str], bool]


def beside_lead(flight: Flight, live_workers: Container[str], fits: Fits) -> m.PlacementReply | None:
    """Choice k > 0 of an n-choice request goes where choice 0 went, whose engine will hold their
    common prompt (one prefill for all n), when that worker is alive, not one to avoid, and fits."""
    lead = flight.follows
    if (lead is not None and lead.worker_id and lead.worker_id in live_workers
            and lead.worker_id != flight.avoid_worker and fits(lead.worker_id, flight.request.band)):
        return m.PlacementReply(target=subjects.worker_target(lead.worker_id), worker_id=lead.worker_id,
                                reason="with choice 0", prefill_worker_id=lead.request.prefill_worker)
    return None


def placement_question(flight: Flight, *, block_size: int, zone: str, timeout_s: float) -> m.PlacementRequest | None:
    """What to ask the router, or None when the answer cannot beat the shared queue: placement is
    off, or the request is shorter than one prefix block and has no adapter, release or zone to keep
    it in (no cache to find, and balancing load is what the shared queue does anyway; skipping the
    round trip saves ~1 ms)."""
    request = flight.request
    if timeout_s <= 0 or not (flight.block_hashes or request.adapter or request.release or zone):
        return None
    return m.PlacementRequest(
        request_id=request.request_id, model=request.model, adapter=request.adapter,
        prompt_tokens=(request.prompt_tokens or 0) + request.resumed_tokens, band=request.band,
        block_hashes=flight.block_hashes, block_size=block_size if flight.block_hashes else 0,
        release=request.release, pinned=request.release_pinned, zone=zone,
    )


def judge_placement(placement: m.PlacementReply, flight: Flight, live_workers: Container[str],
                    fits: Fits) -> Literal["take", "gone", "over_budget"]:
    """Whether the router's answer is taken: not a worker this gateway does not see alive or must
    avoid (`gone`), nor one whose queue would hold it past its band's budget (`over_budget`: any
    worker may take it). A pinned request waits for its release however long the queue: no other
    worker may take it."""
    worker_id = placement.worker_id
    if worker_id and (worker_id not in live_workers or worker_id == flight.avoid_worker):
        return "gone"
    if worker_id and not flight.request.release_pinned and not fits(worker_id, flight.request.band):
        return "over_budget"
    return "take"


def pinned_worker(flight: Flight, live_workers: Mapping[str, m.Heartbeat], queued_on: Callable[[str], int],
                  zone: str) -> m.PlacementReply | None:
    """Where a request pinned to a release (an eval run) goes without a router's answer: the ready
    worker of that release with the fewest of this gateway's requests queued on it, in the
    gateway's zone when one is there, not one to avoid, never a prefill worker. None: no worker of
    the release is up (the caller refuses the request rather than let another release answer)."""
    request = flight.request
    own = [beat for worker_id, beat in live_workers.items()
           if beat.release == request.release and beat.model == request.model and beat.state == "ready"
           and beat.role != "prefill" and worker_id != flight.avoid_worker]
    if not own:
        return None
    in_zone = [beat for beat in own if beat.zone == zone] if zone else []
    chosen = min(in_zone or own, key=lambda beat: (queued_on(beat.worker_id), beat.worker_id))
    return m.PlacementReply(target=subjects.worker_target(chosen.worker_id), worker_id=chosen.worker_id,
                            reason="pinned release")
