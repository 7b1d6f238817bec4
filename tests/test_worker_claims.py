"""The claim decision: which delivery of a request attempt runs (services/worker/claims.py)."""

from proto import subjects
from services.worker.claims import holder_name, verdict

ME = holder_name("worker-1", 1700000000.25)


def test_an_unclaimed_attempt_runs() -> None:
    assert verdict(None, ME, holder_alive=False) == "run"


def test_an_attempt_claimed_here_or_by_a_live_worker_is_absorbed() -> None:
    assert verdict(ME, ME, holder_alive=True) == "absorb"
    assert verdict(ME, ME, holder_alive=False) == "absorb"  # it ran here already (its ack was lost)
    assert verdict(holder_name("worker-2", 5.0), ME, holder_alive=True) == "absorb"


def test_an_attempt_whose_claimer_died_is_taken_over() -> None:
    assert verdict(holder_name("worker-2", 5.0), ME, holder_alive=False) == "take_over"


def test_a_restarted_worker_is_another_holder() -> None:
    assert holder_name("worker-1", 1.0) != holder_name("worker-1", 2.0)


def test_claim_keys_are_one_per_attempt_and_valid_for_any_request_id() -> None:
    keys = {subjects.claim_key(rid, attempt) for rid in ("abc", "a.b*c>", "batch_1-line 7") for attempt in (0, 1)}
    assert len(keys) == 6
    assert all(set(key) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.") for key in keys)
