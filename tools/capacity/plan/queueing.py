"""The wait of a prompt for prefill when the router pools c replicas' prefill queues.

The router's default policy places a request on the replica with the least queued prefill work it
has heard of (docs/routing.md), which makes the fleet's prefill queues one queue in front of c
servers rather than c queues of one: an M/G/c queue, not c M/G/1 queues. With the arrival rate per
replica λ, a prompt's prefill time S (E[S], E[S²]) and ρ = λ · E[S] < 1:

    C    = Erlang C(c, c · ρ)                          the chance a prompt waits at all
    m    = E[S²] ÷ (2 · E[S]) ÷ (c · (1 − ρ))          the mean of a wait, given there is one
    W_q  = C · m                                       the mean wait (Allen–Cunneen: M/M/c × (1 + C_s²) ÷ 2)
    P(W > w) = C · exp(−w ÷ m)                         so the p90 wait is m · ln(10 · C), 0 when C ≤ 10%

With c = 1, C = ρ and W_q is Pollaczek–Khinchine's M/G/1 mean exactly. The tail is M/M/c's shape
with the M/G/c mean (Allen and Cunneen's approximation, as in Gross and Harris, "Fundamentals of
Queueing Theory", and Whitt's "Approximations for the GI/G/m queue", 1993).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

P90 = 0.9


def erlang_c(servers: int, offered: float) -> float:
    """The chance an arrival waits in an M/M/c queue with `offered` = λ ÷ μ Erlangs (1 if unstable)."""
    if servers < 1:
        raise ValueError("a queue needs at least one server")
    rho = offered / servers
    if rho >= 1:
        return 1.0
    blocked = 1.0  # Erlang B by its recurrence: stable where the closed form overflows
    for k in range(1, servers + 1):
        blocked = offered * blocked / (k + offered * blocked)
    return blocked / (1 - rho + rho * blocked)


@dataclass(frozen=True)
class Wait:
    waits: float  # C: the chance a prompt waits at all
    mean_s: float  # W_q
    p90_s: float


def prefill_wait(rate_per_server: float, mean_s: float, square_s: float, servers: int = 1) -> Wait:
    """The wait of a prompt in front of `servers` pooled prefill servers, each offered
    `rate_per_server` prompts/s of mean prefill time `mean_s` and mean square `square_s`."""
    rho = rate_per_server * mean_s
    if rho >= 1:
        return Wait(1.0, math.inf, math.inf)
    if rho <= 0 or mean_s <= 0:
        return Wait(0.0, 0.0, 0.0)
    waits = erlang_c(servers, servers * rho)
    given = square_s / (2 * mean_s) / (servers * (1 - rho))
    p90 = given * math.log(waits / (1 - P90)) if waits > 1 - P90 else 0.0
    return Wait(waits, waits * given, p90)
