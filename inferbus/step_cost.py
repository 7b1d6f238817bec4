"""The step-time cap on batch lines: how many may run beside interactive work on one engine. Pure.

Every running sequence lengthens the engine step that all sequences share. With the step linear in
the running count, `t(B) ≈ base + per_seq·B`, adding `b` batch sequences next to `i` interactive
ones slows the step by `per_seq·b / (base + per_seq·i)`; keeping that at most `max_slowdown`
gives `b ≤ max_slowdown · (base/per_seq + i)`. The batch service's feed counts this cap over the
fleet and each worker enforces it where lines are pulled; both take `base` and `per_seq` from the
engine's GPU and tensor-parallel width (which the worker reads from the engine and reports), so a
fleet of H200s is not capped with H100 numbers.

`base` and `per_seq` of H100 TP2 at a typical 2,048-token context per sequence are the reference
(18.6 ms with one sequence, 39.6 ms with 128: 0.165 ms per added sequence); other GPUs and TP
widths scale them by the roofline timing model (`inferbus.timing`, which
gives each of its constants with its public source): an engine's cost is the H100 TP2 constants
times the model's ratio between that engine and H100 TP2. An engine the model does not know
(SGLang does not report its GPU) is capped with the configured constants.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from inferbus.timing import roofline

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


# H100 TP2, latency preset, 2k context; also where the engine's GPU is unknown.
DEFAULT = StepCost(base_s=0.0186, per_seq_s=0.000165)
_REFERENCE = ("H100", 2)  # what DEFAULT was measured on


def _model_cost(gpu: str, tp: int) -> tuple[float, float]:
    model = roofline(gpu, tp)
    base = model.step_time(1, CONTEXT_TOKENS)
    per_seq = (model.step_time(_FIT_BATCH, _FIT_BATCH * CONTEXT_TOKENS) - base) / (_FIT_BATCH - 1)
    return base, per_seq


@functools.cache
def engine_step_cost(gpu: str, tp: int) -> StepCost | None:
    """The step cost of `tp` GPUs of type `gpu`: DEFAULT scaled by the timing model; None when the
    model does not know them."""
    try:
        base, per_seq = _model_cost(gpu, tp)
    except ValueError:
        return None
    reference_base, reference_per_seq = _model_cost(*_REFERENCE)
    return StepCost(base_s=DEFAULT.base_s * base / reference_base,
                    per_seq_s=DEFAULT.per_seq_s * per_seq / reference_per_seq)


def step_cost(gpu: str, tp: int, fallback: StepCost = DEFAULT) -> StepCost:
    """The engine's step cost from its GPU and TP, or `fallback` for an engine the model does not know."""
    return engine_step_cost(gpu, tp) or fallback


def batch_cap(max_slowdown: float, step_seqs: float, interactive_running: int) -> int:
    """The most batch lines beside `interactive_running` that slow the step by at most
    `max_slowdown`; `step_seqs` is `StepCost.seqs` of the engine."""
    return int(max_slowdown * (step_seqs + max(0, interactive_running)))
