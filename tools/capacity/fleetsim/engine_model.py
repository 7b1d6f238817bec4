"""The step-time model a simulated replica runs, with the engine's options (pure).

The fleet simulators price every step with the same `StepTimeModel` the simulated engine and the
planner use (`inferbus/timing.py`); this builds it from an `EngineConfig` as the
simulated engine does: weight and KV precision, speculative decoding (k draft tokens at an
acceptance rate: each step gives every decoding sequence E = (1 − α^(k+1)) ÷ (1 − α) tokens and
costs k draft steps plus a verify step k + 1 tokens wide) and the batched LoRA kernels' cost.

LoRA's cost depends on the traffic, not the engine: a step pays for the distinct adapters in its
batch. `AdapterTraffic` prices each step at the expected number when requests spread evenly over
`adapters` (`inferbus.timing.expected_distinct_adapters`, as the planner's replica model does), at most
the engine's adapter slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferbus.timing import (
    RooflineModel,
    SpecDecoding,
    StepTimeModel,
    expected_distinct_adapters,
    roofline,
)
from services.sim_engine.config import EngineConfig


@dataclass(frozen=True)
class AdapterTraffic:
    """`model` with every step's batch spread evenly over `adapters` LoRA adapters."""

    model: StepTimeModel
    adapters: int
    slots: int

    @property
    def tokens_per_step(self) -> float:
        return self.model.tokens_per_step

    def step_time(self, batch_decode: int, resident_ctx_tokens: int, prefill_tokens: int = 0,
                  prefill_mean_ctx: float = 0.0, lora_adapters: float = 0.0) -> float:
        # Counted over the decoding batch, as the planner's replica model counts them.
        distinct = expected_distinct_adapters(batch_decode, self.adapters, self.slots)
        return self.model.step_time(batch_decode, resident_ctx_tokens, prefill_tokens, prefill_mean_ctx, distinct)


def roofline_for(engine: EngineConfig, *, lora: bool = False) -> RooflineModel:
    """The roofline with the engine's precision, speculative decoding and (with `lora`) LoRA rank."""
    spec = (SpecDecoding(engine.speculative_num_steps, engine.speculative_acceptance, engine.speculative_draft_cost)
            if engine.speculative_num_steps else None)
    return roofline(engine.gpu, engine.tp, engine.preset,
                    weights="fp8" if engine.quantization == "fp8" else "bf16",
                    kv_cache="fp8" if engine.kv_cache_dtype == "fp8_e4m3" else "bf16",
                    spec=spec, lora_rank=engine.priced_lora_rank if lora else 0,
                    lora_slots=engine.max_loras_per_batch if lora else 0)


def step_model_for(engine: EngineConfig, lora_adapters: int = 0) -> StepTimeModel:
    """What one replica of `engine` costs per step, its traffic spread over `lora_adapters` adapters (0: none)."""
    if lora_adapters < 0:
        raise ValueError("lora_adapters must not be negative")
    model = roofline_for(engine, lora=lora_adapters > 0)
    if lora_adapters == 0:
        return model
    return AdapterTraffic(model, lora_adapters, engine.max_loras_per_batch)
