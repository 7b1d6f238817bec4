"""The batch step-time cap, one function for the worker and the batch feed, sized by the engine's GPU."""

from __future__ import annotations

import pytest

from inferbus import step_cost
from proto import messages as m
from services.batch.feed import FeedPolicy
from services.worker.preemption import PreemptionConfig, PreemptionPolicy


def test_h100_tp2_is_the_reference_and_other_engines_scale_by_the_timing_model() -> None:
    assert step_cost.engine_step_cost("H100", 2) == step_cost.DEFAULT
    h200, model = step_cost.engine_step_cost("H200", 2), step_cost._model_cost
    assert h200 is not None
    assert h200.base_s / step_cost.DEFAULT.base_s == pytest.approx(model("H200", 2)[0] / model("H100", 2)[0])
    assert h200.per_seq_s / step_cost.DEFAULT.per_seq_s == pytest.approx(model("H200", 2)[1] / model("H100", 2)[1])


def test_known_gpus_come_from_the_model_unknown_ones_from_the_fallback() -> None:
    h200 = step_cost.step_cost("H200", 2)
    assert h200.base_s < step_cost.DEFAULT.base_s  # faster memory: a shorter step
    assert step_cost.engine_step_cost("", 0) is None and step_cost.engine_step_cost("A100", 2) is None
    fallback = step_cost.StepCost(0.02, 0.0002)
    assert step_cost.step_cost("A100", 2, fallback) is fallback
    with pytest.raises(ValueError):
        step_cost.StepCost(0.0, 0.001)


def test_batch_cap() -> None:
    assert step_cost.batch_cap(0.1, 100.0, 0) == 10
    assert step_cost.batch_cap(0.1, 100.0, 50) == 15
    assert step_cost.batch_cap(0.1, 100.0, -3) == 10


def _load(gpu: str, tp: int) -> m.WorkerLoad:
    return m.WorkerLoad(worker_id="w", model="m", ts=0.0, seq=1, running=0, waiting=0, in_flight=40, max_running=256,
                        kv_used_tokens=0, kv_capacity_tokens=1, gpu=gpu, tp=tp)


@pytest.mark.parametrize(("gpu", "tp"), [("H100", 2), ("H200", 2), ("H100", 8), ("H200", 1), ("", 0)])
def test_worker_and_feed_agree_on_every_engine(gpu: str, tp: int) -> None:
    feed = FeedPolicy(lambda: 0.0)
    worker = PreemptionPolicy(PreemptionConfig().for_engine(gpu, tp))
    feed_cap = feed.worker_cap(_load(gpu, tp))
    assert feed_cap == worker.step_cap(40)
    expected = step_cost.batch_cap(0.06, step_cost.step_cost(gpu, tp).seqs, 40)
    assert feed_cap == expected
