"""The simulated engine's LoRA rules that follow SGLang 0.5.23 (measured by the contract suite,
tests/sglang): the rank check against --max-lora-rank, the implicit reload of an adapter loaded
before, the message for one never loaded, and an adapter changing greedy output."""

import json
from pathlib import Path

import pytest

from services.sim_engine.config import EngineConfig
from services.sim_engine.lora_files import adapter_problem
from services.sim_engine.lora_pool import host_to_gpu_s
from services.sim_engine.request import Request, RequestRejected
from services.sim_engine.sampling import SamplingParams
from services.sim_engine.scheduler import Engine


def adapter_dir(tmp_path: Path, name: str, rank: int) -> str:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    return str(directory)


def test_a_local_adapter_above_the_rank_limit_is_refused_with_sglangs_message(tmp_path: Path) -> None:
    assert adapter_problem("small", adapter_dir(tmp_path, "small", 4), 8) is None
    problem = adapter_problem("big", adapter_dir(tmp_path, "big", 16), 8)
    assert problem is not None and "with rank 16 is incompatible" in problem and "--max-lora-rank" in problem
    assert adapter_problem("big", str(tmp_path / "big"), None) is None  # no limit given
    (tmp_path / "empty").mkdir()
    assert "adapter_config.json" in (adapter_problem("empty", str(tmp_path / "empty"), 8) or "")
    assert adapter_problem("remote", "s3://adapters/remote", 8) is None  # not local: judged elsewhere


def engine() -> Engine:
    return Engine(EngineConfig(fixed_step_ms=10.0, block_size=4, lora_load_time_s=0.0))


def greedy(engine: Engine, rid: str, lora: str | None = None) -> list[int]:
    request = Request(rid=rid, input_ids=list(range(1, 20)), sampling=SamplingParams(max_new_tokens=6, temperature=0.0),
                      lora_name=lora)
    engine.add(request)
    while engine.has_work:
        engine.step()
    return request.output_ids


def test_an_unloaded_adapter_is_loaded_again_by_a_request_and_a_never_loaded_one_is_refused() -> None:
    sim = engine()
    assert sim.load_lora("ada", "/adapters/ada").success and sim.unload_lora("ada").success
    assert greedy(sim, "again", "ada")
    assert "ada" in sim.adapters
    with pytest.raises(RequestRejected, match="Got LoRA adapter that has never been loaded: ghost"):
        greedy(sim, "ghost", "ghost")


def test_an_adapter_changes_greedy_output() -> None:
    sim = engine()
    assert sim.load_lora("ada", "/adapters/ada").success
    assert greedy(sim, "base") == greedy(sim, "base-again")
    assert greedy(sim, "with-adapter", "ada") != greedy(sim, "base-third")


def copy_into_gpu(overlap: bool) -> tuple[float, float, Request]:
    """A base request decoding, then one for an adapter in host memory but in no GPU slot: the
    longest step, and how long after its arrival the adapter request's first token came."""
    sim = Engine(EngineConfig(fixed_step_ms=10.0, block_size=4, max_loras_per_batch=4, lora_overlap_loading=overlap))
    assert sim.load_lora("ada", "/adapters/ada").success
    sim.advance(1.0)  # read from disk into host memory
    sim.add(Request(rid="base", input_ids=list(range(1, 20)), sampling=SamplingParams(max_new_tokens=40)))
    sim.step()
    sim.step()
    request = Request(rid="lora", input_ids=list(range(1, 20)), sampling=SamplingParams(max_new_tokens=2),
                      lora_name="ada")
    sim.add(request)
    arrived, first_token_at, longest = sim.now, None, 0.0
    while sim.has_work:
        longest = max(longest, sim.step().duration_s)
        if first_token_at is None and request.output_ids:
            first_token_at = sim.now
    assert first_token_at is not None
    return longest, first_token_at - arrived, request


def test_overlap_loading_copies_an_adapter_into_its_gpu_slot_beside_the_steps() -> None:
    copy_s = host_to_gpu_s(16, pinned=False)  # the first copy pins the weights either way
    # SGLang's default: the step that needs the adapter waits for its copy, and so does every request in it.
    longest, ttft, _ = copy_into_gpu(overlap=False)
    assert longest == pytest.approx(0.010 + copy_s)
    # --enable-lora-overlap-loading: steps keep their length; the adapter's request joins once copied.
    longest, ttft, request = copy_into_gpu(overlap=True)
    assert longest == pytest.approx(0.010)
    assert copy_s <= ttft <= copy_s + 0.03
    assert request.finish_reason is not None
