"""The simulated engine's engine options (precision, speculative decoding, LoRA cost) follow the
timing model the planner uses, so `inferbus sweep` against it measures them."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from inferbus.timing import SpecDecoding, roofline
from services.sim_engine.cli import sim_engine_command
from services.sim_engine.config import EngineConfig
from services.sim_engine.request import Request
from services.sim_engine.sampling import SamplingParams
from services.sim_engine.scheduler import Engine


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 100_000 for i in range(length)]


def decode_steps(engine: Engine, max_new_tokens: int) -> tuple[int, list[int]]:
    """Steps after the prefill step, and the tokens each step added."""
    engine.add(Request("r", prompt(1, 64), SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)))
    engine.step()  # prefill + first token
    per_step = []
    while engine.has_work:
        before = len(engine.get("r").output_ids) if engine.get("r") else 0
        result = engine.step()
        after = result.updates[-1].num_output_tokens if result.updates else before
        per_step.append(after - before)
    return len(per_step), per_step


def test_speculative_decoding_emits_the_expected_tokens_per_step() -> None:
    config = EngineConfig(fixed_step_ms=10.0, block_size=4, chunked_prefill_size=64,
                          speculative_num_steps=3, speculative_acceptance=0.7)
    steps, per_step = decode_steps(Engine(config), 2001)
    # E = (1 − 0.7⁴) ÷ 0.3 = 2.533 tokens per step; 2,000 tokens after the first in about 790 steps.
    assert sum(per_step) == 2000
    assert max(per_step) <= 4 and min(per_step) >= 1
    assert 2000 / steps == pytest.approx(SpecDecoding(3, 0.7).tokens_per_step, rel=0.05)


def test_speculative_step_is_priced_by_the_timing_model() -> None:
    config = EngineConfig(chunked_prefill_size=2048, speculative_num_steps=3, speculative_acceptance=0.7)
    engine = Engine(config)
    engine.add(Request("one", prompt(1, 2048), SamplingParams(max_new_tokens=50)))
    engine.step()
    decode = engine.step()
    spec = roofline("H100", 2, spec=SpecDecoding(3, 0.7))
    assert decode.duration_s == pytest.approx(spec.step_time(1, decode_context(engine)), rel=0.01)
    assert decode.duration_s > roofline("H100", 2).step_time(1, 2050)


def decode_context(engine: Engine) -> int:
    return sum(r.context_len for r in engine.running) - 1


def test_bf16_kv_cache_halves_the_capacity_and_bf16_weights_need_tp4() -> None:
    fp8 = Engine(EngineConfig())
    bf16_kv = Engine(EngineConfig(kv_cache_dtype="auto"))
    assert bf16_kv.cache.capacity_tokens == pytest.approx(fp8.cache.capacity_tokens / 2, rel=0.001)
    with pytest.raises(ValueError, match="no KV cache on 2 × H100"):
        EngineConfig(quantization="none")
    bf16 = Engine(EngineConfig(quantization="none", kv_cache_dtype="auto", tp=4, chunked_prefill_size=2048))
    bf16.add(Request("one", prompt(1, 100), SamplingParams(max_new_tokens=2)))
    bf16.step()
    step = bf16.step()
    assert step.duration_s == pytest.approx(
        roofline("H100", 4, weights="bf16", kv_cache="bf16").step_time(1, 100), rel=0.02)


def test_lora_adapters_in_the_batch_add_their_step_cost() -> None:
    def decode_step(adapter: str | None) -> float:
        engine = Engine(EngineConfig(lora_load_time_s=0.0, max_lora_rank=64))
        request = Request("r", prompt(2, 100), SamplingParams(max_new_tokens=3))
        if adapter:
            assert engine.load_lora(adapter, f"/adapters/{adapter}").success
            request.lora_name = adapter
        engine.add(request)
        engine.step()
        return engine.step().duration_s

    base, with_adapter = decode_step(None), decode_step("ada")
    assert with_adapter - base == pytest.approx(roofline("H100", 2, lora_rank=64).lora_step_s(1, 1), rel=0.01)


def test_cli_refuses_bad_options_with_the_reason() -> None:
    result = CliRunner().invoke(sim_engine_command, ["--quantization", "none"])
    assert result.exit_code != 0 and "no KV cache" in result.output
    result = CliRunner().invoke(sim_engine_command, ["--speculative-acceptance", "1.5"])
    assert result.exit_code != 0 and "--speculative-acceptance" in result.output
