"""bench/pd_live.py's summary of one topology's run: latencies in simulated seconds and goodput."""

from __future__ import annotations

from bench.pd_live import summarise
from bench.routing import Outcome


def outcome(index: int, ttft: float, tpot: float, tokens: int = 11, error: str | None = None) -> Outcome:
    # Wall seconds at time scale 0.5: simulated = wall / 0.5.
    sent = float(index)
    first = sent + ttft * 0.5
    return Outcome(index, sent, sent=sent, first=first, end=first + tpot * 0.5 * (tokens - 1), prompt_tokens=100,
                   cached_tokens=40, completion_tokens=tokens, error=error)


def test_goodput_counts_requests_within_both_slos_per_gpu_second() -> None:
    runs = [outcome(0, 0.5, 0.03), outcome(1, 0.9, 0.03), outcome(2, 0.5, 0.05), outcome(3, 0.2, 0.01),
            outcome(4, 0.1, 0.01, error="HTTP 503")]
    result = summarise(runs, wall=10.0, time_scale=0.5, gpus=4, ttft_slo=0.8, tpot_slo=0.04)
    assert (result["ok"], result["errors"], result["within_slo"]) == (4, 1, 2)  # too slow a TTFT, a TPOT; an error
    assert result["sim_seconds"] == 20.0
    assert abs(result["goodput_req_s_per_gpu"] - 2 / 20 / 4) < 1e-12
    assert abs(result["ttft_p90_s"] - 0.9) < 0.1 and result["hit_rate"] == 0.4
    assert (result["within_ttft_share"], result["within_tpot_share"]) == (3 / 5, 3 / 5)
