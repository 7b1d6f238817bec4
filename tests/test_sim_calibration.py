"""The simulator against NVIDIA NIM's published closed-loop points (Llama-3.3-70B FP8, 2×H100 TP2,
input 5000 / output 500), in virtual time. See docs/sim-engine.md for the measured table."""

import pytest

from services.sim_engine.closed_loop import simulate_closed_loop
from services.sim_engine.config import EngineConfig

# concurrency: (ITL ms, output tok/s)
NIM_H100_TP2 = {1: (18.6, 52), 5: (21.8, 218), 25: (38.8, 623), 50: (59.7, 814)}
MEASURED_REQUESTS = {1: 2, 5: 10, 25: 40, 50: 80}


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", sorted(NIM_H100_TP2))
def test_default_config_reproduces_nim_closed_loop_points(concurrency):
    # The default 512-token per-step prefill budget spreads each prompt over the decode steps
    # that run alongside it, which is how the published ITLs behave (see docs/sim-engine.md).
    config = EngineConfig(gpu="H100", tp=2, preset="latency")
    assert config.chunked_prefill_size == 512
    stats = simulate_closed_loop(config, concurrency, 5000, 500, n_requests=MEASURED_REQUESTS[concurrency])
    itl_ms, tokens_per_s = NIM_H100_TP2[concurrency]
    assert stats.mean_itl_s * 1e3 == pytest.approx(itl_ms, rel=0.15)
    assert stats.output_tokens_per_s == pytest.approx(tokens_per_s, rel=0.15)
    assert stats.preemptions == 0


@pytest.mark.slow
def test_a_2048_token_budget_stays_close_to_published_points():
    # A 2048-token budget (what the capacity planner's worked example assumes) bunches prefill
    # into fewer, longer steps: still within 20%.
    for concurrency in (1, 50):
        stats = simulate_closed_loop(
            EngineConfig(chunked_prefill_size=2048), concurrency, 5000, 500, n_requests=MEASURED_REQUESTS[concurrency]
        )
        itl_ms, tokens_per_s = NIM_H100_TP2[concurrency]
        assert stats.mean_itl_s * 1e3 == pytest.approx(itl_ms, rel=0.20)
        assert stats.output_tokens_per_s == pytest.approx(tokens_per_s, rel=0.20)


def test_single_stream_ttft_matches_published_prefill_time():
    stats = simulate_closed_loop(EngineConfig(), 1, 5000, 500, n_requests=2)
    assert stats.mean_ttft_s * 1e3 == pytest.approx(407, rel=0.15)
    short_prompt = simulate_closed_loop(EngineConfig(), 1, 500, 2000, n_requests=1)
    assert short_prompt.mean_itl_s * 1e3 == pytest.approx(18.9, rel=0.10)
    assert short_prompt.mean_ttft_s * 1e3 == pytest.approx(48, rel=0.15)


@pytest.mark.slow
def test_saturation_queues_instead_of_speeding_up():
    # Concurrency 100 overflows the 419k-token KV cache: throughput flattens, TTFT explodes.
    config = EngineConfig()
    at_50 = simulate_closed_loop(config, 50, 5000, 500, n_requests=50)
    at_100 = simulate_closed_loop(config, 100, 5000, 500, n_requests=100)
    assert at_100.output_tokens_per_s < at_50.output_tokens_per_s * 1.25
    assert at_100.mean_ttft_s > 5 * at_50.mean_ttft_s
