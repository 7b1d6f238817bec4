from services.worker.engine_health import EngineHealth
from services.worker.service import engine_max_running

import pytest

from services.worker.engine import EngineError


def test_probes_back_off_exponentially_and_recovery_says_the_engine_was_down() -> None:
    now = [0.0]
    health = EngineHealth(lambda: now[0], first_delay_s=0.1, max_delay_s=2.0)
    assert health.up and not health.recovered()
    delays = [health.failed() for _ in range(7)]
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert not health.up and health.down_since == 0.0 and health.failures == 7
    assert health.recovered() and health.up and health.failures == 0
    assert health.failed() == 0.1  # a new outage starts from the first delay again


def test_max_running_comes_from_internal_states_when_the_flag_was_not_given() -> None:
    # SGLang 0.5.23 without --max-running-requests: null at the top, the effective value per DP rank.
    info = {"max_running_requests": None, "dp_size": 1,
            "internal_states": [{"effective_max_running_requests_per_dp": 2048}]}
    assert engine_max_running(info) == 2048
    assert engine_max_running({**info, "dp_size": 2}) == 4096
    assert engine_max_running({**info, "max_running_requests": 8}) == 8
    with pytest.raises(EngineError):
        engine_max_running({"max_running_requests": None})
