import pytest

from inferbus.timing import FixedStepModel, roofline

# The roofline's step times worked out by hand (docs/sim-engine.md), latency preset, 2k context per decode sequence;
# prefill columns are a fresh prompt of n tokens (mean attended context n/2), no decode.
DECODE_TABLE = {
    ("H100", 2): (18.6, 23.7, 29.0, 39.6),
    ("H100", 4): (12.2, 15.5, 18.9, 25.8),
    ("H200", 2): (14.3, 18.5, 22.9, 31.6),
    ("H200", 4): (10.0, 12.9, 15.9, 21.8),
}
PREFILL_TABLE = {
    ("H100", 2): (80, 304, 621),
    ("H100", 4): (43, 155, 313),
    ("H200", 2): (79, 303, 620),
    ("H200", 4): (42, 154, 313),
}


@pytest.mark.parametrize(("gpu", "tp"), list(DECODE_TABLE))
def test_decode_step_times_match_published_table(gpu, tp):
    model = roofline(gpu, tp, "latency")
    for batch, expected_ms in zip((1, 32, 64, 128), DECODE_TABLE[(gpu, tp)]):
        got_ms = model.step_time(batch, batch * 2048) * 1e3
        assert got_ms == pytest.approx(expected_ms, rel=0.05), (gpu, tp, batch)


@pytest.mark.parametrize(("gpu", "tp"), list(PREFILL_TABLE))
def test_prefill_step_times_match_published_table(gpu, tp):
    model = roofline(gpu, tp, "latency")
    for tokens, expected_ms in zip((1000, 4000, 8000), PREFILL_TABLE[(gpu, tp)]):
        got_ms = model.step_time(0, 0, tokens, tokens / 2) * 1e3
        assert got_ms == pytest.approx(expected_ms, rel=0.05), (gpu, tp, tokens)


def test_kv_capacity_matches_published_estimate():
    assert roofline("H100", 2).kv_capacity_tokens() == pytest.approx(419_000, rel=0.01)
    assert roofline("H200", 2).kv_capacity_tokens() == pytest.approx(1_100_000, rel=0.01)
    assert roofline("H100", 1).kv_capacity_tokens() < roofline("H100", 2).kv_capacity_tokens()


def test_throughput_preset_is_faster_and_monotonic():
    latency, throughput = roofline("H100", 2, "latency"), roofline("H100", 2, "throughput")
    assert throughput.step_time(128, 128 * 2048) < latency.step_time(128, 128 * 2048)
    times = [latency.step_time(b, b * 2048) for b in (1, 8, 64, 256)]
    assert times == sorted(times)
    assert latency.step_time(1, 2048, 512, 256) > latency.step_time(1, 2048)


def test_invalid_configuration_is_rejected():
    with pytest.raises(ValueError):
        roofline("A100", 2)
    with pytest.raises(ValueError):
        roofline("H100", 3)
    with pytest.raises(ValueError):
        roofline("H100", 2, "fast")


def test_fixed_step_model_ignores_batch():
    model = FixedStepModel(0.01)
    assert model.step_time(1, 10) == model.step_time(256, 10**6, 2048, 1000) == 0.01
