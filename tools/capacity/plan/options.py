"""What each engine option changes: the plan again with one option flipped, side by side.

For the plan's own choice (its cheapest row) and for the cheapest row of each variant:

- precision: FP8 weights and KV cache against BF16 weights and KV (and FP8 weights over a BF16
  KV cache), the largest lever on a 70B model's memory;
- speculative decoding: the plan's candidate (or, without one, `DEFAULT_SPEC`) turned on where it
  raises goodput, against none;
- LoRA: the traffic spread over 1, 8 and 32 adapters (or none, when the plan has adapters).

Pure: each variant is `make_plan` on a copy of the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from inferbus.timing import SpecDecoding
from tools.capacity.plan.planner import Plan, PlanInputs, Row, make_plan

# EAGLE-style draft head with 3 draft tokens at a per-token acceptance of 0.7 (≈ 2.5 tokens per
# verify step, inside the 2–4 accepted tokens per step EAGLE reports for chat on Llama-class
# models): an assumption until a sweep with the real draft model measures it.
DEFAULT_SPEC = SpecDecoding(draft_tokens=3, acceptance=0.7)
ADAPTER_COUNTS = (1, 8, 32)


@dataclass(frozen=True)
class Variant:
    label: str
    inputs: PlanInputs
    same_config: Row | None  # the row with the plan's GPU and TP
    cheapest: Row | None


def _spec_label(spec: SpecDecoding) -> str:
    return f"speculative decoding (k={spec.draft_tokens}, α={spec.acceptance:g}, E={spec.tokens_per_step:.2f})"


def variant_inputs(inputs: PlanInputs) -> list[tuple[str, PlanInputs]]:
    """The plan's inputs with one engine option changed at a time; the plan itself first."""
    out = [("as planned", inputs)]
    if (inputs.weights, inputs.kv_cache) != ("bf16", "bf16"):
        out.append(("BF16 weights and KV cache", replace(inputs, weights="bf16", kv_cache="bf16")))
    if (inputs.weights, inputs.kv_cache) != ("fp8", "fp8"):
        out.append(("FP8 weights and KV cache", replace(inputs, weights="fp8", kv_cache="fp8")))
    if inputs.weights == "fp8" and inputs.kv_cache == "fp8":
        out.append(("FP8 weights, BF16 KV cache", replace(inputs, kv_cache="bf16")))
    if inputs.spec is None:
        out.append((f"+ {_spec_label(DEFAULT_SPEC)}", replace(inputs, spec=DEFAULT_SPEC)))
    else:
        out.append(("without speculative decoding", replace(inputs, spec=None)))
    if inputs.lora_adapters:
        out.append(("no LoRA adapters", replace(inputs, lora_adapters=0)))
    for count in ADAPTER_COUNTS:
        if count != inputs.lora_adapters:
            out.append((f"LoRA: {count} adapter{'s' if count > 1 else ''} of rank {inputs.lora_rank}, "
                        f"{inputs.lora_slots} slots", replace(inputs, lora_adapters=count)))
    return out


def compare(plan: Plan) -> list[Variant]:
    """Every variant's row for the plan's chosen GPU × TP and its own cheapest row (variants: model goodput only)."""
    chosen = plan.cheapest
    variants = []
    for label, inputs in variant_inputs(plan.inputs):
        # Variants price the aggregated rows only: the topology is chosen for the plan itself.
        result = plan if inputs is plan.inputs else make_plan(replace(inputs, disaggregation=False))
        same = None
        if chosen is not None:
            same = next((r for r in result.rows if (r.gpu, r.tp) == (chosen.gpu, chosen.tp)), None)
        variants.append(Variant(label, inputs, same, result.cheapest))
    return variants
