"""The step-time cap on batch lines: how many may run beside interactive work on one engine. Pure.

Every running sequence lengthens the engine step that all sequences share. With the step linear in
the running count, `t(B) ≈ base + per_seq·B`, adding `b` batch sequences next to `i` interactive
ones slows the step by `per_seq·b / (base + per_seq·i)`; keeping that at most `max_slowdown`
gives `b ≤ max_slowdown · (base/per_seq + i)`. The batch service's feed counts this cap over the
fleet and each worker enforces it where lines are pulled; both take `base` and `per_seq` from the
engine's GPU and tensor-parallel width (which the worker reads from the engine and reports), so a
fleet of H200s is not capped with H100 numbers.

`base` and `per_seq` come from the roofline timing model (`services.sim_engine.perf_model`) at a
typical 2,048-token context per sequence: H100 TP2 gives 18.6 ms with one sequence and 39.9 ms
with 128, so ≈ 0.168 ms per added sequence (that module gives each constant with its public
source). An engine the model does not know (SGLang does not report its GPU) is capped with the
configured constants.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from services.sim_engine.perf_model import roofline

CONTEXT_TOKENS = 2048  # context per sequence the constants are taken at
_FIT_BATCH = 128  # the per-sequence slope is taken between one sequence and this many


@dataclass(frozen=True)
class StepCost:
    base_s: float  # step time with one sequence
    per_seq_s: float  # added per running sequence

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.per_seq_s <= 0:
            raise ValueError("step-time constants must be positive")

    @property
    def seqs(self) -> float:
        """The base step expressed in sequences: base / per_seq."""
        return self.base_s / self.per_seq_s


# Where the engine's GPU is unknown: the model's H100 TP2 values (latency preset, 2k context), rounded.
DEFAULT = StepCost(base_s=0.0186, per_seq_s=0.000168)


@functools.cache
def engine_step_cost(gpu: str, tp: int) -> StepCost | None:
    """The timing model's step cost for `tp` GPUs of type `gpu`; None when it does not know them."""
    try:
        model = roofline(gpu, tp)
    except ValueError:
        return None
    base = model.step_time(1, CONTEXT_TOKENS)
    per_seq = (model.step_time(_FIT_BATCH, _FIT_BATCH * CONTEXT_TOKENS) - base) / (_FIT_BATCH - 1)
    return StepCost(base_s=base, per_seq_s=per_seq)


def step_cost(gpu: str, tp: int, fallback: StepCost = DEFAULT) -> StepCost:
    """The engine's step cost from its GPU and TP, or `fallback` for an engine the model does not know."""
    return engine_step_cost(gpu, tp) or fallback


def batch_cap(max_slowdown: float, step_seqs: float, interactive_running: int) -> int:
    """The most batch lines beside `interactive_running` that slow the step by at most
    `max_slowdown`; `step_seqs` is `StepCost.seqs` of the engine."""
    return int(max_slowdown * (step_seqs + max(0, interactive_running)))
