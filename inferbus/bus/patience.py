"""How long a placement question waits for the router's answer (gateways placing a request, decode
workers asking for a prefill worker). `PlacementPatience` is pure, with an injected clock; `ask`
puts the question with it.

A request whose placement does not come back goes to the shared queue, where any worker with room
takes it: no prefix cache, no adapter home, no view of the workers' own queues. When the router is
gone that is right, and known at once (NATS answers "no responders" when nobody subscribes). When
the router is alive but slow, because a CPU limit throttles its pod or the host is busy with other
work, taking its slowness for absence turns placement into chance exactly when the fleet can least
afford it: a long prompt placed by chance computes its whole prefix again. On the routing benchmark's
long-prompt trace with the host's CPU taken by other work, most answers came back after a 200 ms
wait and the prefix hit rate fell from 55% to 25-46% (bench/README.md, "Placement when the control
plane is slow").

So the wait follows what the router has been doing. While it answers (an answer, in time or late,
within the last `answering_window_s`), a placement waits up to `patience_s` for it: a late answer
is still made from the router's whole view. When it has not answered for that long (stopped, its
connection stuck, its subscription still registered so that NATS cannot say "no responders"), the
wait is the short `budget_s` again until the next answer, so a hung router costs each request at
most `budget_s` once it is known to be hung.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from .replies import Replies

# A placement answer this long after its question is no longer awaited: the router did not answer.
LATE_ANSWER_S = 30.0


@dataclass
class PlacementPatience:
    budget_s: float  # the wait while the router is not known to answer (INFERBUS_PLACEMENT_TIMEOUT_MS)
    patience_s: float  # the wait while it answers (INFERBUS_PLACEMENT_PATIENCE_MS); at most budget_s: never longer
    clock: Callable[[], float]
    answering_window_s: float = 5.0  # an answer this recent says the router answers
    _answered_at: float = field(default=float("-inf"), init=False)

    def answering(self) -> bool:
        return self.clock() - self._answered_at <= self.answering_window_s

    def wait_s(self) -> float:
        """How long the next placement question waits for its answer."""
        if self.answering():
            return max(self.budget_s, self.patience_s)
        return self.budget_s

    def answered(self) -> None:
        """An answer arrived (in time, or after its question stopped waiting)."""
        self._answered_at = self.clock()


Observe = Callable[[str, float], None]


async def ask(replies: Replies, subject: str, data: bytes, patience: PlacementPatience,
              observe: Observe = lambda outcome, seconds: None) -> Msg | None:
    """Ask the router `subject`, waiting `patience.wait_s()`: its answer, or None without one in
    time (then the question's answer, should it come later, still tells `patience` the router
    answers). `observe(outcome, seconds)`: `answered`, `late` or `unanswered` (no router, or
    none within `LATE_ANSWER_S`)."""
    asked = time.monotonic()
    answer = asyncio.ensure_future(replies.request(subject, data, LATE_ANSWER_S))
    done, _ = await asyncio.wait({answer}, timeout=patience.wait_s())
    if not done:
        answer.add_done_callback(lambda late: _late(late, asked, patience, observe))
        return None
    try:
        reply = answer.result()
    except (NoRespondersError, NatsTimeoutError):
        observe("unanswered", time.monotonic() - asked)
        return None
    patience.answered()
    observe("answered", time.monotonic() - asked)
    return reply


def _late(answer: asyncio.Future[Msg], asked: float, patience: PlacementPatience, observe: Observe) -> None:
    if answer.cancelled() or answer.exception() is not None:
        observe("unanswered", time.monotonic() - asked)
        return
    patience.answered()
    observe("late", time.monotonic() - asked)
