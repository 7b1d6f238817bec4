import pytest

from inferbus.tokens.blocks import encode
from services.sim_engine.config import EngineConfig
from services.sim_engine.output import OUTPUT_PIECES
from services.sim_engine.request import Request, RequestRejected
from services.sim_engine.sampling import SamplingParams
from services.sim_engine.scheduler import Engine


def make_engine(**overrides) -> Engine:
    settings = {"fixed_step_ms": 10.0, "block_size": 4, "chunked_prefill_size": 64, "answer_length_median": 0}
    settings.update(overrides)
    return Engine(EngineConfig(**settings))


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 100_000 for i in range(length)]


def request(rid: str, length: int = 10, seed: int = 0, **sampling) -> Request:
    sampling.setdefault("max_new_tokens", 5)
    return Request(rid=rid, input_ids=prompt(seed, length), sampling=SamplingParams(**sampling))


def run_until_done(engine: Engine, max_steps: int = 10_000) -> list:
    updates = []
    for _ in range(max_steps):
        if not engine.has_work:
            return updates
        updates.extend(engine.step().updates)
    raise AssertionError("engine did not finish")


def finished(updates, rid):
    return next(u for u in updates if u.request.rid == rid and u.finish_reason is not None)


def test_every_output_piece_is_one_token():
    for piece in set(OUTPUT_PIECES):
        assert len(encode(piece)) == 1, piece


def test_continuous_batching_decodes_all_running_requests_each_step():
    engine = make_engine()
    for i in range(3):
        engine.add(request(f"r{i}", seed=i))
    first = engine.step()
    # All three prompts fit in one 64-token chunk: each gets its first token in step one.
    assert first.prefill_tokens == 30 and first.batch_decode == 0
    assert len(first.updates) == 3
    second = engine.step()
    assert second.batch_decode == 3 and second.prefill_tokens == 0
    updates = run_until_done(engine)
    for i in range(3):
        done = finished(updates, f"r{i}")
        assert done.finish_reason == {"type": "length", "length": 5}
        assert done.num_output_tokens == 5
    assert engine.now == pytest.approx(0.05)  # 5 steps of 10 ms: batched, not serial


def test_chunked_prefill_respects_token_budget():
    engine = make_engine(chunked_prefill_size=64)
    engine.add(request("long", length=150))
    sizes = []
    while True:
        result = engine.step()
        sizes.append(result.prefill_tokens)
        if result.updates:
            break
    assert sizes == [64, 64, 22]
    assert result.updates[0].num_output_tokens == 1


def test_prefix_cache_hit_skips_prefill_and_reports_cached_tokens():
    engine = make_engine()
    engine.add(request("a", length=40, seed=1))
    run_until_done(engine)
    engine.add(request("b", length=40, seed=1))
    result = engine.step()
    # 40 tokens: 9 full 4-token blocks usable (one token is always recomputed) -> 36 cached.
    assert result.prefill_tokens == 4
    assert engine.get("b").cached_tokens == 36
    assert engine.cache_hit_rate == pytest.approx(36 / 80)
    engine.add(request("c", length=40, seed=2))
    assert engine.step().prefill_tokens == 40
    assert engine.get("c").cached_tokens == 0


def test_prefix_cache_is_namespaced_by_lora_adapter():
    engine = make_engine(lora_load_time_s=0.0)
    engine.load_lora("ada", "/adapters/ada")
    engine.add(request("base", length=40, seed=1))
    run_until_done(engine)
    lora_request = request("lora", length=40, seed=1)
    lora_request.lora_name = "ada"
    engine.add(lora_request)
    engine.step()
    assert lora_request.cached_tokens == 0


def test_requests_wait_while_kv_cache_is_full():
    engine = make_engine(kv_capacity_tokens=64, chunked_prefill_size=256)
    engine.add(request("a", length=40, seed=1, max_new_tokens=8))
    engine.add(request("b", length=40, seed=2, max_new_tokens=8))
    engine.step()
    assert engine.load().num_running_reqs == 1 and engine.load().num_waiting_reqs == 1
    updates = run_until_done(engine)
    assert finished(updates, "b").finish_reason["type"] == "length"
    b = next(u.request for u in updates if u.request.rid == "b")
    a = next(u.request for u in updates if u.request.rid == "a")
    assert b.first_token_time > a.finish_time - 1e-9


def test_running_request_is_preempted_when_kv_overflows_and_still_completes():
    # Admission only reserves part of the future output, so long generations overflow.
    engine = make_engine(kv_capacity_tokens=96, chunked_prefill_size=256)
    engine.add(request("old", length=30, seed=1, max_new_tokens=40))
    engine.step()
    engine.add(request("new", length=30, seed=2, max_new_tokens=40))
    updates = run_until_done(engine)
    assert engine.preemptions_total >= 1
    for rid in ("old", "new"):
        done = finished(updates, rid)
        assert done.finish_reason == {"type": "length", "length": 40}
        assert len(done.request.output_ids) == 40
    assert engine.cache.private_tokens == 0
    # The victim is the newest request; the older one never restarted.
    assert finished(updates, "old").request.preemptions == 0


def test_abort_uses_prefix_semantics():
    engine = make_engine()
    for rid in ("job-1", "job-2", "other"):
        engine.add(request(rid, max_new_tokens=50))
    engine.step()
    aborted = engine.abort("job-")
    assert sorted(u.request.rid for u in aborted) == ["job-1", "job-2"]
    assert all(u.finish_reason["type"] == "abort" for u in aborted)
    assert engine.load().num_running_reqs == 1
    assert engine.abort("oth", exact=True) == []
    assert len(engine.abort("")) == 1
    assert not engine.has_work and engine.cache.private_tokens == 0


def test_abort_of_waiting_request():
    engine = make_engine()
    engine.add(request("w"))
    [update] = engine.abort("w")
    assert update.num_output_tokens == 0 and not engine.has_work


def test_duplicate_rid_is_rejected_until_finished():
    engine = make_engine()
    engine.add(request("dup"))
    with pytest.raises(RequestRejected, match="Duplicate request ID detected"):
        engine.add(request("dup"))
    run_until_done(engine)
    engine.add(request("dup"))


def test_higher_priority_is_admitted_first():
    engine = make_engine(max_running_requests=1)
    engine.add(request("busy", max_new_tokens=3))
    engine.step()
    engine.add(Request("low", prompt(1, 10), SamplingParams(max_new_tokens=3), priority=0))
    engine.add(Request("high", prompt(2, 10), SamplingParams(max_new_tokens=3), priority=5))
    updates = run_until_done(engine)
    high, low = finished(updates, "high").request, finished(updates, "low").request
    assert high.first_token_time < low.first_token_time


def test_much_higher_priority_preempts_running_request():
    engine = make_engine(max_running_requests=1, priority_preemption_threshold=10)
    engine.add(Request("low", prompt(1, 10), SamplingParams(max_new_tokens=20), priority=0))
    engine.step()
    engine.add(Request("mid", prompt(2, 10), SamplingParams(max_new_tokens=2), priority=10))
    engine.step()
    assert engine.get("mid") in engine.waiting  # not more important by more than the threshold
    engine.add(Request("urgent", prompt(3, 10), SamplingParams(max_new_tokens=2), priority=11))
    engine.step()
    assert engine.get("urgent") in engine.running and engine.get("low") in engine.waiting
    updates = run_until_done(engine)
    assert finished(updates, "low").request.preemptions == 1
    assert len(finished(updates, "low").request.output_ids) == 20


def test_without_priority_scheduling_priorities_are_ignored():
    engine = make_engine(max_running_requests=1, priority_scheduling=False)
    engine.add(Request("low", prompt(1, 10), SamplingParams(max_new_tokens=5), priority=0))
    engine.step()
    engine.add(Request("first", prompt(2, 10), SamplingParams(max_new_tokens=2), priority=-100))
    engine.add(Request("urgent", prompt(3, 10), SamplingParams(max_new_tokens=2), priority=100))
    engine.step()
    assert engine.get("low") in engine.running  # nothing retracted for the "urgent" one
    updates = run_until_done(engine)
    assert finished(updates, "low").request.preemptions == 0
    # First come, first served.
    assert finished(updates, "first").request.first_token_time < finished(updates, "urgent").request.first_token_time


def test_unknown_lora_adapter_is_rejected_with_sglang_message():
    engine = make_engine()
    bad = request("x")
    bad.lora_name = "nope"
    with pytest.raises(RequestRejected, match="Got LoRA adapter that has never been loaded: nope"):
        engine.add(bad)


def test_lora_load_time_delays_requests_for_that_adapter_only():
    engine = make_engine(lora_load_time_s=0.2)
    assert engine.load_lora("ada", "/adapters/ada").success
    lora_request = request("with-lora")
    lora_request.lora_name = "ada"
    engine.add(lora_request)
    engine.add(request("base", seed=3))
    run_until_done(engine)
    assert engine.get("base") is None
    assert lora_request.first_token_time >= 0.2
    result = engine.load_lora("broken", "missing/adapter")
    assert not result.success and "broken" not in result.loaded_adapters
    assert engine.unload_lora("ada").success and not engine.unload_lora("ada").success


def test_lora_slots_limit_adapters_per_batch():
    engine = make_engine(max_loras_per_batch=2, lora_load_time_s=0.0)
    for name in ("a", "b"):
        engine.load_lora(name, f"/adapters/{name}")
    reqs = []
    for i, name in enumerate(("a", "b")):
        r = request(f"r-{name}", seed=i, max_new_tokens=4)
        r.lora_name = name
        engine.add(r)
        reqs.append(r)
    engine.add(request("r-base", seed=9, max_new_tokens=4))
    engine.step()
    # Two adapters fill both slots; the base model would need a third, so it waits.
    assert {r.rid for r in engine.running} == {"r-a", "r-b"}
    base = engine.get("r-base")
    run_until_done(engine)
    assert base.first_token_time > reqs[1].finish_time - 1e-9


def test_stop_string_truncates_text_and_reports_match():
    engine = make_engine()
    engine.add(request("s", max_new_tokens=500, temperature=0.0, stop=["."]))
    done = finished(run_until_done(engine), "s")
    assert done.finish_reason == {"type": "stop", "matched": "."}
    assert "." not in done.text
    assert done.num_output_tokens < 500
    assert done.text == done.request.text


def test_no_stop_trim_keeps_stop_string_and_min_new_tokens_delays_stop():
    engine = make_engine()
    engine.add(request("keep", max_new_tokens=500, temperature=0.0, stop="\n", no_stop_trim=True))
    engine.add(request("late", max_new_tokens=500, temperature=0.0, stop=".", min_new_tokens=50, seed=3))
    updates = run_until_done(engine)
    assert finished(updates, "keep").text.endswith("\n")
    late = finished(updates, "late")
    assert late.num_output_tokens >= 50 and late.finish_reason["type"] == "stop"


def test_stop_token_ids():
    engine = make_engine()
    full = request("probe", max_new_tokens=30, temperature=0.0)
    engine.add(full)
    run_until_done(engine)
    target = full.output_ids[4]
    engine.add(request("stop", max_new_tokens=30, temperature=0.0, stop_token_ids=[target]))
    done = finished(run_until_done(engine), "stop")
    assert done.finish_reason == {"type": "stop", "matched": target}
    assert done.request.output_ids[-1] == target and len(done.request.output_ids) <= 5


def test_output_is_deterministic():
    def generate(rid: str, **sampling):
        engine = make_engine()
        engine.add(request(rid, max_new_tokens=20, **sampling))
        return finished(run_until_done(engine), rid).request

    greedy_a, greedy_b = generate("a", temperature=0.0), generate("b", temperature=0.0)
    assert greedy_a.text == greedy_b.text and greedy_a.output_ids == greedy_b.output_ids
    sampled_a, sampled_b = generate("a"), generate("b")
    assert sampled_a.text != sampled_b.text
    assert generate("a").text == sampled_a.text
    assert generate("x", sampling_seed=7).text == generate("y", sampling_seed=7).text


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1).verify()
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(n=2).verify()
    with pytest.raises(ValueError, match="at most 32"):
        SamplingParams(stop=[str(i) for i in range(33)]).verify()
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=2, min_new_tokens=3).verify()
    SamplingParams(stop="x", max_new_tokens=0).verify()


def test_zero_max_new_tokens_finishes_after_prefill():
    engine = make_engine()
    engine.add(request("z", max_new_tokens=0))
    done = finished(run_until_done(engine), "z")
    assert done.finish_reason == {"type": "length", "length": 0} and done.num_output_tokens == 0


def test_roofline_step_time_is_used_by_default():
    engine = Engine(EngineConfig(chunked_prefill_size=2048))
    engine.add(Request("one", prompt(1, 2048), SamplingParams(max_new_tokens=2)))
    first = engine.step()
    second = engine.step()
    assert first.duration_s == pytest.approx(0.155, rel=0.05)  # 2048-token prefill
    assert second.duration_s == pytest.approx(0.0186, rel=0.05)  # one decode sequence
