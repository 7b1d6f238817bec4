"""The prefill pool's own TTFT, as a prefill worker observes it for the autoscaler. Pure.

A request reaches a prefill worker only once a decode worker holds it: decode workers pull the
queue and send the prefill halves. The time a request waits before a decode worker takes it is
therefore the decode pool's shortage (too few decode slots), and counting it against the prefill
pool would grow the wrong pool when decode is short. The prefill pool's TTFT runs from the decode
worker's first ask for the prompt (kept across refusals and retries: a prefill pool so full that it
refuses is short, and that wait is its own) to the prompt's KV sent.
"""

from __future__ import annotations

from proto import messages as m


def prefill_ttft(ask: m.PrefillRequest, kv_sent_at: float) -> float:
    """Seconds of the prefill pool's own TTFT for `ask`, whose KV was sent at `kv_sent_at` (wall
    seconds). A decode worker that does not say when it asked (older ones): from the gateway's
    accept, as before."""
    start = ask.asked_at if ask.asked_at > 0 else ask.request.created
    return max(0.0, kv_sent_at - start)
