"""The batch service's pure parts: input validation, the feed policy, line formatting, the tracker."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from inferbus.openai.errors import OpenAIError
from inferbus.tokens.prompt import load_model, render_prompt
from proto import bands
from proto import messages as m
from services.batch import lines
from services.batch.feed import FeedConfig, FeedPolicy
from services.batch.tracker import (
    MAX_DOUBT_ATTEMPTS,
    ActiveBatch,
    Tracker,
    parse_request_id,
    publishes_next_attempt,
)
from services.batch.validate import Limits, Validated, validate

MODEL = "meta-llama/Llama-3.3-70B-Instruct"
CHAT = "/v1/chat/completions"


def chat_line(custom_id: str, content: str = "hi", model: str = MODEL, url: str = CHAT, **body: object) -> bytes:
    item = {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": content}], **body}}
    return json.dumps(item).encode() + b"\n"


# ---- validation --------------------------------------------------------------------------------


def test_a_valid_file_gives_model_total_ids_and_offsets() -> None:
    data = [chat_line("a"), b"\n", chat_line("b", max_tokens=5), chat_line("c")]
    verdict = validate(data, CHAT)
    assert isinstance(verdict, Validated)
    assert (verdict.model, verdict.total, verdict.custom_ids) == (MODEL, 3, ["a", "b", "c"])
    joined = b"".join(data)
    for offset, custom_id in zip(verdict.offsets, verdict.custom_ids):
        assert json.loads(joined[offset:].split(b"\n", 1)[0])["custom_id"] == custom_id


def test_bad_json_names_its_line() -> None:
    verdict = validate([chat_line("a"), chat_line("b"), b'{"custom_id": "c", "method": \n', chat_line("d")], CHAT)
    assert isinstance(verdict, list) and len(verdict) == 1
    assert verdict[0].line == 3 and "Line 3" in verdict[0].message and verdict[0].code == "invalid_json_line"


def test_duplicate_custom_id_names_both_lines() -> None:
    verdict = validate([chat_line("a"), chat_line("b"), chat_line("a")], CHAT)
    assert isinstance(verdict, list)
    assert [(e.code, e.line) for e in verdict] == [("duplicate_custom_id", 3)]
    assert "line 1" in verdict[0].message


def test_one_model_per_batch() -> None:
    verdict = validate([chat_line("a"), chat_line("b", model="other-model")], CHAT)
    assert isinstance(verdict, list) and [(e.code, e.line, e.param) for e in verdict] == [
        ("mismatched_model", 2, "body.model")
    ]


def test_url_method_and_body_are_checked() -> None:
    bad_method = json.loads(chat_line("m"))
    bad_method["method"] = "GET"
    verdict = validate([
        chat_line("a", url="/v1/completions"),
        json.dumps(bad_method).encode() + b"\n",
        json.dumps({"custom_id": "x", "method": "POST", "url": CHAT, "body": {"model": MODEL}}).encode() + b"\n",
        json.dumps({"method": "POST", "url": CHAT, "body": {}}).encode() + b"\n",
        chat_line("t", temperature=5),
        chat_line("s", stream=True),
    ], CHAT)
    assert isinstance(verdict, list)
    assert [(e.code, e.line) for e in verdict] == [
        ("invalid_url", 1), ("invalid_method", 2), ("missing_required_parameter", 3), ("missing_custom_id", 4),
        ("invalid_value", 5), ("unsupported_value", 6),
    ]
    assert verdict[2].param == "body.messages" and verdict[4].param == "body.temperature"


def test_validation_stops_after_max_errors() -> None:
    verdict = validate([b"not json\n"] * 500, CHAT, Limits(max_errors=7))
    assert isinstance(verdict, list) and len(verdict) == 7 and verdict[-1].line == 7


def test_limits_on_lines_and_bytes() -> None:
    data = [chat_line(str(i)) for i in range(5)]
    too_many = validate(data, CHAT, Limits(max_lines=4))
    assert isinstance(too_many, list) and too_many[0].code == "too_many_requests" and too_many[0].line == 5
    too_big = validate(data, CHAT, Limits(max_bytes=len(data[0]) * 2))
    assert isinstance(too_big, list) and too_big[0].code == "file_too_large"
    assert isinstance(validate(data, CHAT, Limits(max_lines=5)), Validated)


def test_empty_file_unknown_endpoint_and_model_refusal() -> None:
    empty = validate([b"\n", b"  \n"], CHAT)
    assert isinstance(empty, list) and empty[0].code == "empty_file"
    endpoint = validate([chat_line("a")], "/v1/embeddings")
    assert isinstance(endpoint, list) and endpoint[0].code == "invalid_endpoint"
    refused = validate([chat_line("a"), chat_line("b")], CHAT, check_model=lambda model: f"no {model} for you")
    assert isinstance(refused, list) and refused[0].code == "model_not_found" and refused[0].line == 1


def test_completions_lines_parse_as_completions() -> None:
    line = json.dumps({"custom_id": "p", "method": "POST", "url": "/v1/completions",
                       "body": {"model": MODEL, "prompt": "Once upon", "max_tokens": 3}}).encode()
    assert isinstance(validate([line], "/v1/completions"), Validated)
    as_chat = validate([line.replace(b"/v1/completions", CHAT.encode())], CHAT)
    # A completion's body is not a chat's: its `prompt` is unknown there.
    assert isinstance(as_chat, list) and (as_chat[0].code, as_chat[0].param) == ("unknown_parameter", "body.prompt")


# ---- feed policy ---------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def load(worker: str = "w1", *, in_flight: int = 0, batch: int = 0, waiting: int = 0, batch_waiting: int = 0,
         max_running: int = 256, ttft: list[int] | None = None, tpot: list[int] | None = None,
         phase: str = "serving", draining: bool = False, kv: float = 0.1) -> m.WorkerLoad:
    return m.WorkerLoad(
        worker_id=worker, model=MODEL, ts=0.0, seq=0, running=in_flight, waiting=waiting, in_flight=in_flight,
        max_running=max_running, kv_used_tokens=int(kv * 1000), kv_capacity_tokens=1000, phase=phase,
        draining=draining, batch_in_flight=batch, batch_waiting=batch_waiting, ttft_hist=ttft or [],
        tpot_fine_hist=tpot or [],
    )


def hist(bounds: tuple[float, ...], value: float, count: int) -> list[int]:
    counts = [0] * (len(bounds) + 1)
    for _ in range(count):
        m.observe(counts, bounds, value)
    return counts


def run_idle(policy: FeedPolicy, clock: Clock, seconds: float, outstanding: int = 0, **kw: object) -> list[int]:
    allowances = []
    for _ in range(int(seconds / 0.25)):
        clock.now += 0.25
        policy.observe(load("w1", **kw))  # type: ignore[arg-type]
        policy.observe(load("w2", **kw))  # type: ignore[arg-type]
        allowances.append(policy.allowance(outstanding))
    return allowances


def test_no_reports_no_feeding() -> None:
    clock = Clock()
    policy = FeedPolicy(clock, FeedConfig(baseline_wait_s=0))
    assert policy.allowance(0) == 0
    assert policy.state().reason == "no serving workers"
    # Workers appearing is not a recovery from pressure: feeding starts at once, small.
    clock.now += 0.25
    policy.observe(load("w1"))
    assert 0 < policy.allowance(0) <= FeedConfig().initial_per_worker + 1


def test_the_feed_learns_the_interactive_baseline_before_feeding() -> None:
    clock = Clock()
    policy = FeedPolicy(clock)  # baseline_wait_s: 15 s
    # Interactive work running: the feed waits while it learns.
    allowances = run_idle(policy, clock, 17, in_flight=10)
    assert allowances[: int(14.5 / 0.25)] == [0] * int(14.5 / 0.25)
    assert allowances[-1] > 0
    # No interactive work at all: nothing to learn from, feeding starts at once.
    clock2 = Clock()
    idle = FeedPolicy(clock2)
    assert run_idle(idle, clock2, 1)[-1] > 0


def test_worker_cap_follows_the_step_time_model_and_the_free_slots() -> None:
    config = FeedConfig(step_base_s=0.02, step_per_seq_s=0.0002, max_slowdown=0.1, reserve_slots=4)
    policy = FeedPolicy(Clock(), config)
    # 10% of (100 + interactive running) sequences.
    assert policy.worker_cap(load(in_flight=0)) == 10
    assert policy.worker_cap(load(in_flight=50, batch=0)) == 15
    # Batch lines already running are not interactive: they do not raise the cap.
    assert policy.worker_cap(load(in_flight=60, batch=10)) == 15
    # A small engine: slots bind first, minus the reserve kept for interactive arrivals.
    assert policy.worker_cap(load(in_flight=6, max_running=12)) == 2
    assert policy.worker_cap(load(in_flight=12, max_running=12)) == 0


def test_grows_toward_spare_and_never_past_it() -> None:
    clock = Clock()
    policy = FeedPolicy(clock)
    spare = 2 * policy.worker_cap(load())
    allowances = run_idle(policy, clock, 40)
    assert allowances[-1] < spare or allowances[0] < spare  # starts small
    assert max(allowances) == spare == allowances[-1]
    assert all(a <= spare for a in allowances)
    assert allowances == sorted(allowances)
    state = policy.state()
    assert not state.pressure and state.spare == spare and state.workers == 2
    # Lines out count against the room.
    assert policy.allowance(spare - 3) == 3 and policy.allowance(spare + 5) == 0


def test_a_worker_with_interactive_work_waiting_gets_no_share_the_rest_is_fed() -> None:
    clock = Clock()
    policy = FeedPolicy(clock)
    run_idle(policy, clock, 40)
    one = policy.worker_cap(load(in_flight=40, batch=10))
    clock.now += 0.25
    # w1's engine keeps 6 interactive requests waiting: w1 gets no share, w2 still does.
    policy.observe(load("w1", in_flight=40, batch=10, waiting=6))
    policy.observe(load("w2", in_flight=40, batch=10))
    state = policy.state()
    assert not state.pressure and state.pressured_workers == 1 and "waiting" in state.reason
    assert state.spare == one and 0 < policy.allowance(0) <= one
    # Batch lines queued in w1's engine are not interactive work kept waiting: w1 is fed again.
    clock.now += 0.25
    policy.observe(load("w1", in_flight=40, batch=10, waiting=6, batch_waiting=5))
    state = policy.state()
    assert state.pressured_workers == 0 and state.spare == 2 * one


def test_a_step_of_new_arrivals_is_not_pressure_nor_batch_waiting() -> None:
    clock = Clock()
    policy = FeedPolicy(clock)
    assert run_idle(policy, clock, 30, in_flight=20, waiting=2)[-1] > 0
    # Only batch work waits: the engine is full of filler, no interactive request is hurt.
    assert run_idle(policy, clock, 5, in_flight=30, batch=30, waiting=10, batch_waiting=10)[-1] > 0


def test_pauses_and_drops_fast_when_interactive_ttft_or_tpot_pass_the_slo_cap() -> None:
    for field, bounds, slow in (("ttft", m.LATENCY_BUCKETS_S, 0.95), ("tpot", m.TPOT_BUCKETS_S, 0.047)):
        clock = Clock()
        policy = FeedPolicy(clock)
        run_idle(policy, clock, 40)
        assert policy.allowance(0) > 0
        before = policy.state().target
        fast = 0.2 if field == "ttft" else 0.02
        base = hist(bounds, fast, 100)
        policy.observe(load("w1", **{field: base}))
        clock.now += 0.25
        # 50 slow interactive requests since the last report: their p90 is over the SLO cap
        # (no baseline was learned: no interactive completions while batch was light).
        slow_counts = [a + b for a, b in zip(base, hist(bounds, slow, 50))]
        policy.observe(load("w1", **{field: slow_counts}))
        assert policy.allowance(0) == 0, field
        state = policy.state()
        assert field.upper() in state.reason and state.target <= before * FeedConfig().decrease_factor
        # Past the window the slow requests no longer count: feeding resumes.
        for _ in range(60):
            clock.now += 0.25
            policy.observe(load("w1", **{field: slow_counts}))
            policy.observe(load("w2"))
        assert policy.allowance(0) > 0, field


def _tpot_reports(policy: FeedPolicy, clock: Clock, seconds: float, tpot: float, counts: list[int],
                  batch: int) -> None:
    for _ in range(int(seconds / 0.25)):
        clock.now += 0.25
        for _ in range(10):
            m.observe(counts, m.TPOT_BUCKETS_S, tpot)
        policy.observe(load("w1", in_flight=40 + batch, batch=batch, tpot=list(counts)))
        policy.observe(load("w2", in_flight=40))
        policy.allowance(0)


def test_the_tpot_budget_is_relative_to_the_baseline_learned_while_batch_was_light() -> None:
    clock = Clock()
    policy = FeedPolicy(clock)
    counts = [0] * (len(m.TPOT_BUCKETS_S) + 1)
    _tpot_reports(policy, clock, 15, 0.021, counts, batch=0)  # interactive alone: p90 ~0.021 (1 ms buckets)
    base_ttft, base_tpot = policy.baseline()
    assert base_ttft is None and base_tpot is not None and 0.02 < base_tpot < 0.025
    budget = policy.state().tpot_budget_s
    assert budget is not None and budget == pytest.approx((1 + FeedConfig().latency_tolerance) * base_tpot)
    assert budget < 0.97 * 0.04
    # With batch running, 2% slower is within the budget; the baseline does not absorb it.
    _tpot_reports(policy, clock, 6, 0.021 * 1.02, counts, batch=10)
    assert not policy.state().pressure and policy.baseline()[1] == base_tpot
    # 20% slower than alone: pressure, far under the absolute SLO.
    _tpot_reports(policy, clock, 6, 0.021 * 1.2, counts, batch=10)
    state = policy.state()
    assert state.pressure and "TPOT" in state.reason and "budget" in state.reason
    assert policy.baseline()[1] == base_tpot


def test_fast_interactive_latency_is_not_pressure() -> None:
    clock = Clock()
    policy = FeedPolicy(clock)
    counts = [0] * (len(m.LATENCY_BUCKETS_S) + 1)
    for _ in range(120):
        clock.now += 0.25
        for _ in range(5):
            m.observe(counts, m.LATENCY_BUCKETS_S, 0.3)
        policy.observe(load("w1", ttft=list(counts)))
    assert not policy.state().pressure and policy.allowance(0) > 0


def test_stale_draining_and_warm_workers_offer_nothing() -> None:
    clock = Clock()
    policy = FeedPolicy(clock)
    run_idle(policy, clock, 30)
    assert policy.state().workers == 2
    clock.now += 10  # both went silent
    assert policy.allowance(0) == 0 and policy.state().spare == 0
    policy.observe(load("w3", phase="warm", max_running=0))
    policy.observe(load("w4", draining=True))
    assert policy.state().spare == 0 and policy.allowance(0) == 0


def test_a_worker_with_kv_nearly_full_gets_no_share() -> None:
    clock = Clock()
    policy = FeedPolicy(clock)
    run_idle(policy, clock, 30)
    policy.observe(load("w1", kv=0.95))
    state = policy.state()
    assert "KV" in state.reason and state.pressured_workers == 1
    assert state.spare == policy.worker_cap(load()) and policy.allowance(0) <= state.spare


def test_feed_config_is_checked() -> None:
    with pytest.raises(ValueError):
        FeedConfig(pressure_fraction=0)
    with pytest.raises(ValueError):
        FeedConfig(decrease_factor=1.0)
    with pytest.raises(ValueError):
        FeedConfig(baseline_tau_s=0)


# ---- lines ---------------------------------------------------------------------------------------


def test_chat_line_renders_like_the_gateway(llama3_model_dir: Path) -> None:
    model = load_model(str(llama3_model_dir))
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "stop": "END",
                       "temperature": 0, "seed": 3}).encode()
    plan = lines.plan_line(CHAT, body, model=model, max_model_len=1000, default_max_tokens=64)
    assert plan.kind == "chat" and plan.model == MODEL
    expected = render_prompt(model, messages=[{"role": "user", "content": "Hello"}])
    assert plan.prompt == expected.text and plan.input_ids == expected.ids and plan.prompt_tokens == len(expected.ids)
    assert plan.sampling.max_new_tokens == 64 and plan.sampling.stop == ["END"]
    assert plan.sampling.temperature == 0 and plan.sampling.seed == 3
    request = lines.line_request(plan, batch_id="batch_abc", line=7, tenant="t1", api_key_id="k1", base_model=MODEL,
                                 adapter=None, deadline=99.0, now=10.0, reply_to="inferbus.tok.batch-main", attempt=2)
    assert request.request_id == m.batch_request_id("batch_abc", 7) == "batch_abc-7"
    assert (request.band, request.priority, request.batch_id, request.batch_line) == (
        "batch",
        bands.ENGINE_PRIORITY["batch"],
        "batch_abc",
        7,
    )
    assert (request.attempt, request.deadline, request.created, request.prompt_tokens) == (
        2,
        99.0,
        10.0,
        plan.prompt_tokens,
    )
    assert request.input_ids == plan.input_ids


def test_max_tokens_rules_are_the_gateways(llama3_model_dir: Path) -> None:
    model = load_model(str(llama3_model_dir))
    body = json.dumps({"model": MODEL, "prompt": "x " * 50, "max_tokens": 10}).encode()
    plan = lines.plan_line("/v1/completions", body, model=model, max_model_len=1000, default_max_tokens=64)
    assert plan.kind == "completion" and plan.prompt == "x " * 50 and plan.sampling.max_new_tokens == 10
    no_max = json.dumps({"model": MODEL, "prompt": "x " * 50}).encode()
    room = lines.plan_line("/v1/completions", no_max, model=model, max_model_len=plan.prompt_tokens + 5,
                           default_max_tokens=64)
    assert room.sampling.max_new_tokens == 5
    with pytest.raises(OpenAIError) as error:
        lines.plan_line(
            "/v1/completions", body, model=model, max_model_len=plan.prompt_tokens + 5, default_max_tokens=64
        )
    assert error.value.code == "context_length_exceeded" and error.value.status == 400
    # A chat the model's template refuses is the line's own 400, not a failure of the batch.
    bad = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}, {"role": "function", "name": "f",
                                                                                      "content": "b"}]})
    with pytest.raises(OpenAIError) as refused:
        lines.plan_line(CHAT, bad.encode(), model=model, max_model_len=1000, default_max_tokens=64)
    assert refused.value.status == 400 and "Unknown message role: function" in refused.value.message


def result(ok: bool = True, **kw: object) -> m.BatchLineResult:
    base: dict[str, object] = dict(
        batch_id="batch_abc",
        line=3,
        request_id="batch_abc-3",
        attempt=1,
        finished=1700000000.5,
        ok=ok,
        text="Hello there",
        finish_reason="length",
        usage=m.Usage(prompt_tokens=12, completion_tokens=4, cached_tokens=2),
    )
    base.update(kw)
    return m.BatchLineResult(**base)  # type: ignore[arg-type]


def test_output_lines_hold_what_the_endpoint_returns() -> None:
    entry = json.loads(lines.output_line(result(), "req-3", "chat", MODEL))
    assert entry["custom_id"] == "req-3" and entry["error"] is None
    assert entry["id"].startswith("batch_req_") and entry["id"] == lines.output_id("batch_abc-3")
    response = entry["response"]
    assert response["status_code"] == 200 and response["request_id"] == "batch_abc-3"
    completion = ChatCompletion.model_validate(response["body"])
    assert completion.choices[0].message.content == "Hello there" and completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.total_tokens == 16 and completion.model == MODEL
    assert (
        completion.usage.prompt_tokens_details is not None and completion.usage.prompt_tokens_details.cached_tokens == 2
    )
    text = json.loads(lines.output_line(result(finish_reason="stop"), "req-3", "completion", MODEL))
    parsed = Completion.model_validate(text["response"]["body"])
    assert parsed.object == "text_completion" and parsed.choices[0].text == "Hello there"
    assert parsed.choices[0].finish_reason == "stop"


def test_error_lines_per_request_and_for_lines_that_never_ran() -> None:
    failed = json.loads(lines.output_line(result(ok=False, error_code="context_length_exceeded",
                                                 error_message="too long", status=400, usage=None), "c", "chat", MODEL))
    assert failed["error"] is None and failed["response"]["status_code"] == 400
    assert failed["response"]["body"]["error"] == {"message": "too long", "type": "invalid_request_error",
                                                   "param": None, "code": "context_length_exceeded"}
    cancelled = json.loads(lines.output_line(result(ok=False, error_code="batch_cancelled", error_message=None,
                                                    status=499), "c", "chat", MODEL))
    assert cancelled["response"] is None and cancelled["error"]["code"] == "batch_cancelled"
    expired = json.loads(lines.unfinished_line("batch_abc-9", "c9", lines.EXPIRED))
    assert expired == {"id": lines.output_id("batch_abc-9"), "custom_id": "c9", "response": None,
                       "error": {"code": "batch_expired", "message": expired["error"]["message"]}}
    assert "window" in expired["error"]["message"]


def test_final_lines_keep_input_order_add_up_usage_and_name_what_never_ran() -> None:
    record = m.BatchRecord(id="batch_abc", tenant="t", endpoint=CHAT, input_file_id="file-x", completion_window="24h",
                           created_at=0, expires_at=86400, status="finalizing", total=4, model=MODEL)
    results = {
        0: result(line=0, request_id="batch_abc-0"),
        1: result(ok=False, line=1, request_id="batch_abc-1", error_code="batch_cancelled", error_message=None,
                  status=499, usage=None),
        3: result(line=3, request_id="batch_abc-3"),
    }
    custom_ids = ["c0", "c1", "c2", "c3"]
    expired = lines.final_lines(record, custom_ids, results, expired=True)
    assert [json.loads(line)["custom_id"] for line in expired.outputs] == ["c0", "c3"]
    assert [(json.loads(line)["custom_id"], json.loads(line)["error"]["code"]) for line in expired.errors] == [
        ("c1", "batch_expired"), ("c2", "batch_expired")]  # cancelled because it expired: it says expired
    assert expired.usage == m.BatchUsage(input_tokens=24, cached_tokens=4, output_tokens=8)
    cancelled = lines.final_lines(record, custom_ids, results, expired=False)
    assert [json.loads(line)["error"]["code"] for line in cancelled.errors] == ["batch_cancelled", "batch_cancelled"]
    assert cancelled.outputs == expired.outputs and cancelled.usage == expired.usage
    assert lines.final_lines(record, [], {}, expired=False) == lines.FinalLines([], [], m.BatchUsage())


# ---- tracker -------------------------------------------------------------------------------------


def make_run(batch_id: str, tenant: str, total: int, created_at: int = 0) -> ActiveBatch:
    record = m.BatchRecord(id=batch_id, tenant=tenant, endpoint=CHAT, input_file_id="file-x", completion_window="24h",
                           created_at=created_at, expires_at=created_at + 86400, status="in_progress", total=total,
                           model=MODEL)
    run = ActiveBatch(record=record, custom_ids=[f"c{i}" for i in range(total)], offsets=list(range(total)),
                   base_model=MODEL)
    run.loaded = True
    return run


def done(batch_id: str, line: int, ok: bool = True, completion: int = 5) -> m.BatchLineResult:
    return m.BatchLineResult(batch_id=batch_id, line=line, request_id=m.batch_request_id(batch_id, line), attempt=0,
                             finished=0.0, ok=ok, usage=m.Usage(prompt_tokens=10, completion_tokens=completion))


def test_tenants_take_turns_and_a_tenants_oldest_batch_goes_first() -> None:
    tracker = Tracker(line_lease_s=60)
    tracker.add(make_run("batch_a2", "a", 3, created_at=20), resumed=False)
    tracker.add(make_run("batch_a1", "a", 2, created_at=10), resumed=False)
    tracker.add(make_run("batch_b1", "b", 3, created_at=30), resumed=False)
    taken = [(run.id, line) for run, line, attempt, doubt in tracker.take(6, now=0.0)]
    assert taken == [
        ("batch_a1", 0),
        ("batch_b1", 0),
        ("batch_a1", 1),
        ("batch_b1", 1),
        ("batch_a2", 0),
        ("batch_b1", 2),
    ]
    assert tracker.outstanding() == 6 and tracker.waiting() == 2
    # The turn carries over between calls.
    assert [(r.id, line) for r, line, _, _ in tracker.take(5, now=0.0)] == [("batch_a2", 1), ("batch_a2", 2)]
    assert tracker.take(5, now=0.0) == []


def test_first_result_wins_and_counts_add_up() -> None:
    tracker = Tracker(line_lease_s=60)
    run = make_run("batch_x", "a", 3)
    tracker.add(run, resumed=False)
    tracker.take(3, now=0.0)
    assert tracker.on_result(done("batch_x", 0)) and tracker.on_result(done("batch_x", 1, ok=False, completion=2))
    assert not tracker.on_result(done("batch_x", 0, completion=99))  # a line that ran twice
    assert not tracker.on_result(done("batch_other", 0)) and not tracker.on_result(done("batch_x", 7))
    assert (run.completed, run.failed, run.usage) == (1, 1, m.BatchUsage(input_tokens=20, output_tokens=7))
    assert not run.finished() and tracker.outstanding() == 1 and run.dirty
    tracker.on_result(done("batch_x", 2))
    assert run.finished() and tracker.outstanding() == 0


def test_a_dead_workers_lines_go_out_again_first_with_the_next_attempt() -> None:
    tracker = Tracker(line_lease_s=60)
    run = make_run("batch_x", "a", 4)
    tracker.add(run, resumed=False)
    tracker.take(2, now=0.0)
    tracker.on_accepted(m.Accepted(request_id="batch_x-0", attempt=0, worker_id="w1",
                                  queue_wait=0.1), now=1.0, sender="w1")
    tracker.on_accepted(m.Accepted(request_id="batch_x-1", attempt=0, worker_id="w2",
                                  queue_wait=0.1), now=1.0, sender="w2")
    # w2 preempted line 1 and another worker took it as attempt 1.
    tracker.on_accepted(m.Accepted(request_id="batch_x-1", attempt=1, worker_id="w1",
                                  queue_wait=0.1), now=2.0, sender="w1")
    assert tracker.worker_gone("w2") == 0
    assert tracker.worker_gone("w1") == 2 and tracker.outstanding() == 0
    taken = [(line, attempt) for _, line, attempt, _ in tracker.take(3, now=3.0)]
    assert taken == [(0, 1), (1, 2), (2, 0)]


def test_lines_without_a_result_for_a_lease_go_out_again() -> None:
    tracker = Tracker(line_lease_s=60)
    run = make_run("batch_x", "a", 2)
    tracker.add(run, resumed=False)
    tracker.take(2, now=0.0)
    tracker.on_accepted(m.Accepted(request_id="batch_x-1", attempt=0, worker_id="w1",
                                  queue_wait=0.1), now=30.0, sender="w1")
    assert tracker.expire_leases(now=59.0) == 0
    assert tracker.expire_leases(now=60.0) == 1  # line 0: published at 0, never heard of
    assert [(line, attempt) for _, line, attempt, _ in tracker.take(5, now=61.0)] == [(0, 1)]
    assert tracker.expire_leases(now=90.0) == 1  # line 1: accepted at 30


def test_a_resumed_batch_skips_done_lines_and_marks_the_rest_in_doubt() -> None:
    tracker = Tracker(line_lease_s=60)
    run = make_run("batch_x", "a", 4)
    run.loaded = False
    tracker.add(run, resumed=True)
    assert tracker.take(4, now=0.0) == []  # results still replaying
    tracker.on_result(done("batch_x", 1))
    run.loaded = True
    # A worker requeued line 2 (preemption) and another took it: it is out, not to be published.
    tracker.on_accepted(m.Accepted(request_id="batch_x-2", attempt=1, worker_id="w9",
                                  queue_wait=0.0), now=0.0, sender="w9")
    taken = [(line, attempt, doubt) for _, line, attempt, doubt in tracker.take(4, now=0.0)]
    assert taken == [(0, 0, True), (3, 0, True)]
    tracker.published(run, 0, 2)
    assert run.outstanding[0].attempt == 2 and run.outstanding[2].worker_id == "w9"


def test_stopping_a_batch_returns_its_lines_in_flight_and_feeds_nothing_more() -> None:
    tracker = Tracker(line_lease_s=60)
    run = make_run("batch_x", "a", 5)
    tracker.add(run, resumed=False)
    tracker.take(2, now=0.0)
    tracker.on_accepted(m.Accepted(request_id="batch_x-0", attempt=0, worker_id="w1",
                                  queue_wait=0.1), now=1.0, sender="w1")
    out = tracker.stop_feeding("batch_x")
    assert [line for line, _ in out] == [0, 1] and tracker.waiting() == 0 and tracker.take(5, now=0.0) == []
    # Lines being cancelled stay counted until they report (or the grace ends): nothing goes out again.
    assert tracker.worker_gone("w1") == 0 and tracker.expire_leases(now=1e9) == 0 and tracker.outstanding() == 2
    tracker.unpublished(run, 0, 0)
    assert tracker.take(5, now=0.0) == []
    tracker.remove("batch_x")
    assert tracker.outstanding() == 0 and not tracker.runs


def test_a_failed_publish_puts_the_line_back_in_front() -> None:
    tracker = Tracker(line_lease_s=60)
    run = make_run("batch_x", "a", 3)
    tracker.add(run, resumed=False)
    (_, line, attempt, _), = tracker.take(1, now=0.0)
    tracker.unpublished(run, line, attempt)
    assert [line for _, line, _, _ in tracker.take(3, now=0.0)] == [0, 1, 2]


def test_a_line_in_doubt_goes_out_again_only_while_dedup_drops_its_attempt_ids() -> None:
    assert publishes_next_attempt(stored=False, doubt=True, attempt=0)
    assert not publishes_next_attempt(stored=True, doubt=True, attempt=0)  # this attempt is new: it runs
    assert not publishes_next_attempt(stored=False, doubt=False, attempt=0)  # not in doubt: published before, by us
    assert publishes_next_attempt(stored=False, doubt=True, attempt=MAX_DOUBT_ATTEMPTS - 2)
    assert not publishes_next_attempt(stored=False, doubt=True, attempt=MAX_DOUBT_ATTEMPTS - 1)

def test_request_ids_name_batch_and_line() -> None:
    assert parse_request_id(m.batch_request_id("batch_0123", 42)) == ("batch_0123", 42)
    assert parse_request_id("0123abcd") is None and parse_request_id("batch_x-y") is None


def test_input_lines_decode_loosely() -> None:
    item = lines.decode_line(chat_line("z"))
    assert item.custom_id == "z" and item.url == CHAT and json.loads(item.body_bytes() or b"")["model"] == MODEL
    with pytest.raises(msgspec.ValidationError):
        lines.decode_line(b'{"custom_id": 5}')


def test_settings_scale_the_completion_window_for_tests_only() -> None:
    from services.batch.settings import BatchSettings

    assert BatchSettings().expires_at(1000, 1000 + 86400) == 1000 + 86400
    assert BatchSettings(window_scale=0.0001).expires_at(1000, 1000 + 86400) == 1009
    assert BatchSettings(window_scale=1e-9).expires_at(1000, 1000 + 86400) == 1001
    with pytest.raises(SystemExit):
        BatchSettings(window_scale=0)
    with pytest.raises(SystemExit):
        BatchSettings(pressure_fraction=1.5)


def test_reopen_rebuilds_counts_from_durable_results_and_runs_the_rest_again() -> None:
    tracker = Tracker(line_lease_s=60)
    run = make_run("batch_x", "a", 4)
    tracker.add(run, resumed=False)
    tracker.take(4, now=0.0)
    for line in range(4):
        tracker.on_result(done("batch_x", line))
    assert run.finished()
    tracker.stop_feeding("batch_x")
    # Only lines 0 and 2 are in the stream (the server lost the other two results).
    tracker.reopen("batch_x", [done("batch_x", 0), done("batch_x", 2, ok=False)], missing=[1, 3])
    assert not run.finished() and (run.completed, run.failed) == (1, 1)
    assert run.usage == m.BatchUsage(input_tokens=20, output_tokens=10) and run.dirty
    assert [(line, attempt, doubt) for _, line, attempt, doubt in tracker.take(5, now=1.0)] == [
        (1, 0, True),
        (3, 0, True),
    ]


# ---- lines handed back: the batch service queues its own lines' next attempts only ---------------

BATCH_REPLY = "inferbus.tok.batch-main"


def handed_back(batch_id: str = "batch_x", line: int = 1, **fields: object) -> m.InferenceRequest:
    base: dict[str, object] = dict(
        request_id=m.batch_request_id(batch_id, line), tenant="acme", model=MODEL, prompt="p",
        sampling=m.SamplingParams(max_new_tokens=8), reply_to=BATCH_REPLY, deadline=100.0, created=0.0,
        band="batch", attempt=1, batch_id=batch_id, batch_line=line, api_key_id="")
    return m.InferenceRequest(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(("fields", "why"), [
    ({}, None),  # the control: its own line, its tenant, key and model
    ({"tenant": "other"}, "another_tenant"),
    ({"api_key_id": "k-other"}, "another_tenant"),
    ({"reply_to": "inferbus.tok.gateway"}, "another_owner"),
    ({"model": "other-model"}, "another_model"),
    ({"adapter": "a1"}, "another_model"),
    ({"band": "premium"}, "not_a_batch_line"),
    ({"request_id": "chat-1"}, "not_a_batch_line"),
    ({"batch_line": 2}, "not_a_batch_line"),
    ({"request_id": m.batch_request_id("batch_x", 7), "batch_line": 7}, "not_a_batch_line"),  # past its last line
    ({"request_id": m.batch_request_id("batch_y", 1), "batch_id": "batch_y"}, "batch_not_running"),
])
def test_a_line_handed_back_is_queued_only_as_its_batch_runs_it(fields: dict[str, object], why: str | None) -> None:
    from services.batch import requeue

    run = make_run("batch_x", "acme", 4)
    request = handed_back(**fields)
    parsed = parse_request_id(request.request_id)
    assert requeue.refusal(request, run if parsed and parsed[0] == "batch_x" else None, BATCH_REPLY) == why
    assert (why in requeue.FORGED) == (why not in (None, "batch_not_running"))


def test_a_line_of_a_stopped_batch_or_with_a_result_is_not_queued_again() -> None:
    from services.batch import requeue

    run = make_run("batch_x", "acme", 4)
    run.done[1] = True
    assert requeue.refusal(handed_back(), run, BATCH_REPLY) == "line_over"
    run.done.clear()
    run.feeding = False
    assert requeue.refusal(handed_back(), run, BATCH_REPLY) == "line_over"
    assert "line_over" not in requeue.FORGED
