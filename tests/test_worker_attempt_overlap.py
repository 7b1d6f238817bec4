"""Two attempts of one request on one worker (services/worker/attempt.py): a worker killed and
restarted under its own id takes over the earlier attempt's redelivery and is then handed the next.
The earlier one is given up (its work is the platform's, its usage not the tenant's), and its end
does not drop the later one from what the worker runs."""

from __future__ import annotations

from proto import messages as m
from services.worker.attempt import Attempt, forget, give_up_earlier


def request(attempt: int) -> m.InferenceRequest:
    return m.InferenceRequest(request_id="r1", tenant="t", model="m", prompt="P", reply_to="x",
                              sampling=m.SamplingParams(max_new_tokens=10), deadline=1e12, created=0,
                              prompt_tokens=64, attempt=attempt)


def test_a_later_attempt_gives_up_the_earlier_one_running_here() -> None:
    earlier = Attempt(request=request(0))
    running = {"r1": earlier}
    assert give_up_earlier(running, request(1)) is earlier
    assert earlier.cancelled and earlier.superseded and earlier.given_up
    # Once given up, it is not given up again (nor aborted twice).
    assert give_up_earlier(running, request(2)) is None


def test_the_same_or_an_older_attempt_gives_up_nothing() -> None:
    current = Attempt(request=request(1))
    running = {"r1": current}
    assert give_up_earlier(running, request(1)) is None and give_up_earlier(running, request(0)) is None
    assert not current.cancelled and not current.given_up
    assert give_up_earlier({}, request(1)) is None


def test_the_earlier_attempt_ending_leaves_the_later_one_running() -> None:
    earlier, later = Attempt(request=request(0)), Attempt(request=request(1))
    running = {"r1": later}  # the later attempt took the place when it started
    forget(running, earlier)
    assert running == {"r1": later}
    forget(running, later)
    assert running == {}
