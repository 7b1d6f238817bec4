"""The gateway's pure decisions about a request in flight, the time given: silent streams, requests
a worker never started, lost events, where a request is placed, and what an error bills."""

from proto import messages as m
from proto import subjects
from services.gateway.flight import Flight, error_usage, not_started, went_silent
from services.gateway.placement_choice import beside_lead, judge_placement, pinned_worker, placement_question
from services.gateway.stream_resend import events_lost


def flight(release: str | None = None, pinned: bool = False, **fields: object) -> Flight:
    request = m.InferenceRequest(request_id="r", tenant="t", model="m", prompt="P", reply_to="x",
                                 sampling=m.SamplingParams(max_new_tokens=10), deadline=1e12, created=5.0,
                                 release=release, release_pinned=pinned)
    return Flight(request=request, **fields)  # type: ignore[arg-type]


def beat(worker_id: str, release: str, **fields: object) -> m.Heartbeat:
    return m.Heartbeat(worker_id=worker_id, model="m", engine_url="", started=0.0, ts=0.0, release=release,
                       **fields)  # type: ignore[arg-type]


def test_a_started_stream_is_silent_after_silence_s_with_nothing_left_to_read() -> None:
    quiet = flight(state="accepted", worker_id="w", heard_at=100.0)
    assert not went_silent(quiet, now=101.9, silence_s=2.0)
    assert went_silent(quiet, now=102.1, silence_s=2.0)
    assert not went_silent(quiet, now=102.1, silence_s=0.0)  # off
    quiet.events.put_nowait(m.Accepted(request_id="r", attempt=0, worker_id="w", queue_wait=0.0))
    assert not went_silent(quiet, now=102.1, silence_s=2.0)  # something is still to read
    assert not went_silent(flight(state="queued", worker_id="w", heard_at=100.0), now=200.0, silence_s=2.0)
    assert not went_silent(flight(state="accepted", worker_id="w", heard_at=100.0, resending=True), now=200.0,
                           silence_s=2.0)


def test_a_queued_request_moves_when_its_worker_has_room_or_says_nothing_but_not_when_full() -> None:
    queued = flight(state="queued", worker_id="w", placed_at=10.0)
    assert not not_started(queued, now=14.9, accept_timeout_s=5.0, free_slots=lambda worker_id: 3, fleet_free_slots=0)
    assert not_started(queued, now=15.1, accept_timeout_s=5.0, free_slots=lambda worker_id: 3, fleet_free_slots=0)
    assert not_started(queued, now=15.1, accept_timeout_s=5.0, free_slots=lambda worker_id: None, fleet_free_slots=0)
    assert not not_started(queued, now=15.1, accept_timeout_s=5.0, free_slots=lambda worker_id: 0, fleet_free_slots=9)
    assert not not_started(flight(state="accepted", worker_id="w", placed_at=10.0), now=99.0, accept_timeout_s=5.0,
                           free_slots=lambda worker_id: 3, fleet_free_slots=3)


def test_an_orphan_moves_when_no_worker_started_it_in_time_while_the_fleet_has_room() -> None:
    """Queued on a worker that died (or restarted) and not started anywhere since: it may be in the
    shared queue (the router moved it) or nowhere (the worker had taken it): either way a fleet
    with room would have started it by now."""
    orphan = flight(state="queued", worker_id=None, placed_at=1.0, orphaned_at=10.0)
    free = lambda worker_id: 3  # noqa: E731
    assert not not_started(orphan, now=14.9, accept_timeout_s=5.0, free_slots=free, fleet_free_slots=4)
    assert not_started(orphan, now=15.1, accept_timeout_s=5.0, free_slots=free, fleet_free_slots=4)
    assert not not_started(orphan, now=15.1, accept_timeout_s=5.0, free_slots=free, fleet_free_slots=0)  # all busy
    # Waiting in the shared queue without a worker's death behind it: the fleet's load, not a loss.
    shared = flight(state="queued", worker_id=None, placed_at=1.0)
    assert not not_started(shared, now=99.0, accept_timeout_s=5.0, free_slots=free, fleet_free_slots=4)
    orphan.state = "accepted"
    assert not not_started(orphan, now=99.0, accept_timeout_s=5.0, free_slots=free, fleet_free_slots=4)


def test_missing_events_are_lost_on_a_gap_or_a_dead_worker_not_on_silence_from_a_live_one() -> None:
    unknown = m.ResendReply(state="unknown")
    assert events_lost(unknown, started=True, why="no event for 2.1 s", worker_live=True)
    assert events_lost(None, started=True, why="stream gap: chunk 4, expected 2", worker_live=True)
    assert events_lost(None, started=True, why="no event for 2.1 s", worker_live=False)
    assert not events_lost(None, started=True, why="no event for 2.1 s", worker_live=True)
    assert not events_lost(unknown, started=False, why="stream gap: chunk 4, expected 2", worker_live=False)


def test_the_router_is_asked_only_when_its_answer_can_beat_the_shared_queue() -> None:
    assert placement_question(flight(), block_size=64, zone="", timeout_s=0.05) is None  # under one block
    assert placement_question(flight(block_hashes=[1]), block_size=64, zone="", timeout_s=0.0) is None  # off
    ask = placement_question(flight(block_hashes=[1, 2]), block_size=64, zone="", timeout_s=0.05)
    assert ask is not None and ask.block_hashes == [1, 2] and ask.block_size == 64
    zoned = placement_question(flight(), block_size=64, zone="z1", timeout_s=0.05)
    assert zoned is not None and zoned.zone == "z1" and zoned.block_size == 0


def test_an_answer_naming_a_gone_avoided_or_overfull_worker_is_not_taken() -> None:
    fits = lambda worker_id, band: worker_id != "full"  # noqa: E731
    live = {"w", "full", "avoided"}
    f = flight(avoid_worker="avoided")
    assert judge_placement(m.PlacementReply(target="w", worker_id="w"), f, live, fits) == "take"
    assert judge_placement(m.PlacementReply(target=subjects.ANY_TARGET), f, live, fits) == "take"
    assert judge_placement(m.PlacementReply(target="x", worker_id="gone"), f, live, fits) == "gone"
    assert judge_placement(m.PlacementReply(target="a", worker_id="avoided"), f, live, fits) == "gone"
    assert judge_placement(m.PlacementReply(target="f", worker_id="full"), f, live, fits) == "over_budget"


def test_a_pinned_request_waits_for_its_release_rather_than_go_where_another_release_pulls() -> None:
    fits = lambda worker_id, band: False  # noqa: E731  (every queue is past its budget)
    pinned = flight(release="sha256:cand", pinned=True, avoid_worker="avoided")
    live = {"w", "avoided"}
    assert judge_placement(m.PlacementReply(target="w", worker_id="w"), pinned, live, fits) == "take"
    assert judge_placement(m.PlacementReply(target="a", worker_id="avoided"), pinned, live, fits) == "gone"
    split = flight(release="sha256:cand")  # a canary's split, not a pin: any worker may take it
    assert judge_placement(m.PlacementReply(target="w", worker_id="w"), split, live, fits) == "over_budget"


def test_without_the_routers_answer_a_pinned_request_goes_to_the_least_queued_worker_of_its_release() -> None:
    live = {
        "stable-1": beat("stable-1", "sha256:stable"),
        "cand-busy": beat("cand-busy", "sha256:cand"),
        "cand-idle": beat("cand-idle", "sha256:cand"),
        "cand-prefill": beat("cand-prefill", "sha256:cand", role="prefill"),
        "cand-draining": beat("cand-draining", "sha256:cand", state="draining"),
        "cand-other-model": m.Heartbeat(worker_id="cand-other-model", model="other", engine_url="", started=0.0,
                                        ts=0.0, release="sha256:cand"),
        "cand-avoided": beat("cand-avoided", "sha256:cand"),
    }
    queued = {"cand-busy": 3, "cand-idle": 1, "stable-1": 0, "cand-prefill": 0, "cand-draining": 0,
              "cand-other-model": 0, "cand-avoided": 0}
    pinned = flight(release="sha256:cand", pinned=True, avoid_worker="cand-avoided")
    chosen = pinned_worker(pinned, live, queued.__getitem__, "")
    assert chosen is not None and chosen.worker_id == "cand-idle"
    assert chosen.target == subjects.worker_target("cand-idle")
    queued["cand-idle"] = 5
    assert pinned_worker(pinned, live, queued.__getitem__, "").worker_id == "cand-busy"  # type: ignore[union-attr]
    # In the gateway's zone while a worker of the release is there, however queued.
    live["cand-zoned"] = beat("cand-zoned", "sha256:cand", zone="z2")
    queued["cand-zoned"] = 9
    assert pinned_worker(pinned, live, queued.__getitem__, "z2").worker_id == "cand-zoned"  # type: ignore[union-attr]
    assert pinned_worker(pinned, live, queued.__getitem__, "z3").worker_id == "cand-busy"  # type: ignore[union-attr]
    # No worker of the release: none (the gateway refuses), never a worker of another release.
    assert pinned_worker(flight(release="sha256:gone", pinned=True), live, queued.__getitem__, "") is None


def test_a_later_choice_goes_beside_choice_0_while_that_worker_lives_and_fits() -> None:
    lead = flight(worker_id="w")
    follower = flight(follows=lead)
    placed = beside_lead(follower, {"w"}, lambda worker_id, band: True)
    assert placed is not None and placed.worker_id == "w" and placed.target == subjects.worker_target("w")
    assert beside_lead(follower, set(), lambda worker_id, band: True) is None
    assert beside_lead(follower, {"w"}, lambda worker_id, band: False) is None
    assert beside_lead(flight(follows=lead, avoid_worker="w"), {"w"}, lambda worker_id, band: True) is None


def test_an_error_bills_what_the_client_received_and_the_prompt_only_with_output() -> None:
    f = flight(prompt_tokens=7, worker_id="w")
    billed = error_usage(f, "error", None, delivered_tokens=3, finished=9.0, gateway_id="g")
    usage = billed.usage
    assert (usage.prompt_tokens, usage.completion_tokens, billed.finished, billed.worker_id) == (7, 3, 9.0, "w")
    nothing = error_usage(f, "error", None, delivered_tokens=0, finished=9.0, gateway_id="g")
    assert (nothing.usage.prompt_tokens, nothing.usage.completion_tokens) == (0, 0)
