"""A prefill worker's admission of prefill halves (services/worker/prefill_admission.py): its slots,
its batch cap, and the batch half that gives way to an interactive one."""

from __future__ import annotations

import math

from services.worker.prefill_admission import Admission, HeldHalf, admit


def _admit(batch: bool, held: list[HeldHalf], capacity: int = 3, batch_max: int = 2) -> Admission:
    return admit(batch=batch, capacity=capacity, batch_max_prefilling=batch_max, held=held)


def test_a_free_slot_takes_either_band() -> None:
    held = [HeldHalf("i1", False, 1.0), HeldHalf("b1", True, 2.0)]
    assert _admit(False, held) == Admission(True)
    assert _admit(True, held) == Admission(True)


def test_batch_halves_stop_at_their_cap_with_slots_free() -> None:
    held = [HeldHalf("b1", True, 1.0), HeldHalf("b2", True, 2.0)]
    assert _admit(True, held, capacity=4) == Admission(False, "full")
    assert _admit(False, held, capacity=4) == Admission(True)  # interactive takes the free slot, nothing preempted


def test_an_interactive_half_on_a_full_worker_preempts_the_batch_half_taken_first() -> None:
    # b1 was sent to the engine first: the engine is computing it, and finishes a chunked prefill in progress
    # before it admits a waiting prompt; b2 waits in the engine and yields by priority anyway.
    held = [HeldHalf("b1", True, 1.0), HeldHalf("i1", False, 2.0), HeldHalf("b2", True, 3.0)]
    assert _admit(False, held) == Admission(True, victim="b1")


def test_a_full_worker_without_batch_halves_refuses_and_batch_never_preempts() -> None:
    interactive = [HeldHalf(f"i{n}", False, float(n)) for n in range(3)]
    assert _admit(False, interactive) == Admission(False, "full")
    mixed = [HeldHalf("i1", False, 1.0), HeldHalf("i2", False, 2.0), HeldHalf("b1", True, 3.0)]
    assert _admit(True, mixed) == Admission(False, "full")


def test_a_half_giving_way_frees_its_slot_once_and_is_not_preempted_again() -> None:
    # b1 is already giving way for an earlier interactive half: its slot is that one's, so the
    # next interactive half on the full worker preempts b2, not b1 a second time.
    held = [HeldHalf("b1", True, 1.0, giving_way=True), HeldHalf("b2", True, 3.0), HeldHalf("i1", False, 2.0),
            HeldHalf("i2", False, 4.0)]
    assert _admit(False, held) == Admission(True, victim="b2")
    # Giving way, it frees a slot for a batch half too, within the batch cap.
    assert _admit(True, [HeldHalf("b1", True, 1.0, giving_way=True), HeldHalf("i1", False, 2.0),
                         HeldHalf("i2", False, 3.0)]) == Admission(True)


def test_a_batch_half_not_yet_sent_to_the_engine_is_not_the_one_computing() -> None:
    # b0 was taken but its engine request is still on its way (sent_at inf): b1 is the one computing.
    held = [HeldHalf("b0", True, math.inf), HeldHalf("b1", True, 5.0), HeldHalf("i1", False, 6.0)]
    assert _admit(False, held) == Admission(True, victim="b1")
