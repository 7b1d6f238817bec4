"""The simulated engine's two adapter bands: SGLang's LRU eviction past --max-loaded-loras, its GPU
slot pool, and load times from the adapter's size and source."""

from __future__ import annotations

import pytest

from services.sim_engine.config import EngineConfig
from services.sim_engine.lora_pool import GpuSlots, disk_load_s, host_to_gpu_s
from services.sim_engine.request import Request
from services.sim_engine.sampling import SamplingParams
from services.sim_engine.scheduler import Engine


def engine(**settings: object) -> Engine:
    base = {"fixed_step_ms": 10.0, "block_size": 4, "max_loras_per_batch": 2, "max_loaded_loras": 3}
    return Engine(EngineConfig(**{**base, **settings}))  # type: ignore[arg-type]


def run(eng: Engine) -> None:
    while eng.has_work:
        eng.step()


def request(rid: str, adapter: str | None, tokens: int = 4) -> Request:
    return Request(rid, list(range(1, 9)), SamplingParams(max_new_tokens=tokens), lora_name=adapter)


def test_a_load_past_the_cap_evicts_the_least_recently_used_adapter_and_says_so() -> None:
    eng = engine(lora_load_time_s=0.0)
    for name in ("a", "b", "c"):
        assert eng.load_lora(name, f"/adapters/{name}").success
    eng.add(request("r1", "a"))  # a request makes `a` the most recently used
    run(eng)
    result = eng.load_lora("d", "/adapters/d")
    assert result.success and result.evicted == ("b",)
    assert set(result.loaded_adapters) == {"a", "c", "d"}
    assert eng.lora_evictions_total == 1


def test_pinned_adapters_are_never_evicted() -> None:
    eng = engine(lora_load_time_s=0.0)
    eng.load_lora("a", "/adapters/a", pinned=True)
    eng.load_lora("b", "/adapters/b")
    eng.load_lora("c", "/adapters/c")
    assert eng.load_lora("d", "/adapters/d").evicted == ("b",)


def test_an_evicted_adapter_is_loaded_again_by_its_next_request_evicting_the_next_oldest() -> None:
    eng = engine(lora_load_time_s=0.0)
    for name in ("a", "b", "c", "d"):
        eng.load_lora(name, f"/adapters/{name}")
    assert "a" not in eng.adapters
    eng.add(request("r1", "a"))  # implicit reload, as SGLang's lora_ref_cache does
    assert "a" in eng.adapters and "b" not in eng.adapters
    run(eng)
    assert eng.get("r1") is None and eng.lora_loads_total == 5


def test_requests_holding_an_evicted_adapter_still_finish() -> None:
    eng = engine(lora_load_time_s=0.0)
    eng.load_lora("a", "/adapters/a")
    eng.add(request("r1", "a", tokens=20))
    eng.step()
    for name in ("b", "c", "d"):
        eng.load_lora(name, f"/adapters/{name}")
    assert "a" not in eng.adapters
    finished = []
    while eng.has_work:
        finished += [u for u in eng.step().updates if u.finish_reason is not None]
    assert [u.finish_reason["type"] for u in finished] == ["length"]


def test_gpu_slots_evict_by_lru_among_adapters_the_batch_does_not_use_before_the_base_model() -> None:
    slots = GpuSlots(3, "lru")
    assert slots.prepare({None, "a"}, set()) == [None, "a"]
    slots.prepare({"b"}, set())
    slots.prepare({"a"}, set())  # `a` used again: `b` is now the least recently used adapter
    assert slots.prepare({"c"}, set()) == ["c"]
    assert slots.resident == {None, "a", "c"}
    assert slots.evictions == 1


def test_fifo_gpu_slots_evict_the_first_copied_in() -> None:
    slots = GpuSlots(2, "fifo")
    slots.prepare({"a"}, set())
    slots.prepare({"b"}, set())
    slots.prepare({"a"}, set())
    slots.prepare({"c"}, set())
    assert slots.resident == {"b", "c"}


def test_load_time_grows_with_the_adapter_and_disk_is_slower_than_host_memory() -> None:
    assert disk_load_s(64) > disk_load_s(16) > host_to_gpu_s(16, pinned=False)
    assert host_to_gpu_s(64, pinned=True) > host_to_gpu_s(16, pinned=True)


def test_a_copy_into_a_gpu_slot_reads_no_file_and_pinned_weights_skip_the_pin() -> None:
    # Rank 16: 80 layers × 4 modules × A and B = 640 copies × 5 µs = 3.2 ms, plus 414.19 MB over
    # PCIe at 25 GB/s = 16.57 ms; pinning first adds 414.19 MB at 10 GB/s = 41.42 ms.
    assert host_to_gpu_s(16, pinned=True) == pytest.approx(0.019767, rel=1e-3)
    assert host_to_gpu_s(16, pinned=False) == pytest.approx(0.061186, rel=1e-3)


def overlap_copies(eng: Engine) -> list[float]:
    """Copy durations on the overlap-loading copy stream, as adapters a, b, a take the one slot."""
    durations = []
    for rid, name in (("1", "a"), ("2", "b"), ("3", "a")):
        eng.add(request(rid, name, tokens=1))
        started = eng.now
        eng.step()  # starts the copy, the request waits
        durations.append(eng.gpu_copies[name] - started)
        run(eng)
    return durations


def test_with_overlap_loading_only_an_adapters_first_copy_pins_its_weights() -> None:
    eng = engine(fixed_step_ms=None, max_loras_per_batch=1, max_loaded_loras=None, lora_overlap_loading=True)
    for name in ("a", "b"):
        eng.load_lora(name, f"/adapters/{name}")
    eng.advance(1.0)
    first_a, first_b, again_a = overlap_copies(eng)
    assert first_a == pytest.approx(host_to_gpu_s(16, pinned=False))
    assert first_b == pytest.approx(host_to_gpu_s(16, pinned=False))
    assert again_a == pytest.approx(host_to_gpu_s(16, pinned=True))  # b took its slot; a's pinned copy is kept


def test_a_load_is_priced_by_size_and_a_gpu_copy_costs_a_step() -> None:
    eng = engine(fixed_step_ms=None, max_loras_per_batch=8, max_loaded_loras=None)
    eng.load_lora("a", "/adapters/a")
    assert eng.adapters["a"].ready_at == pytest.approx(disk_load_s(16))
    eng.now = eng.adapters["a"].ready_at
    eng.add(request("base", None, tokens=1))
    plain = eng.step().duration_s
    run(eng)
    eng.add(request("lora", "a", tokens=1))
    with_copy = eng.step().duration_s
    assert with_copy - plain > host_to_gpu_s(16, pinned=False) * 0.9


def test_a_load_stops_every_batch_until_the_adapter_is_read_and_loads_follow_each_other() -> None:
    # SGLang reads the weights inside its scheduler's loop: running requests, base model's
    # included, get no token meanwhile.
    eng = engine(fixed_step_ms=10.0, max_loras_per_batch=8, max_loaded_loras=None, lora_load_time_s=0.3)
    eng.add(request("base", None, tokens=50))
    eng.step()
    eng.step()
    eng.load_lora("a", "/adapters/a")
    eng.load_lora("b", "/adapters/b")
    assert eng.adapters["b"].ready_at == pytest.approx(eng.adapters["a"].ready_at + 0.3)
    stalled = eng.step()
    assert stalled.duration_s == pytest.approx(0.6) and not stalled.updates and not stalled.idle
    assert [u.request.rid for u in eng.step().updates] == ["base"]  # the batch runs again


def test_the_cap_must_hold_a_batch() -> None:
    with pytest.raises(ValueError, match="max_loaded_loras"):
        EngineConfig(max_loras_per_batch=8, max_loaded_loras=4)
