"""What the simulated engine's native endpoints answer, as pure functions (services/sim_engine/
reports.py, pd_reports.py), and the output a prompt decides up front (scripted.py)."""

from __future__ import annotations

import json

import pytest

from inferbus.timing import KV_LINKS, LLAMA_70B
from services.sim_engine import pd_reports, reports
from services.sim_engine.config import EngineConfig
from services.sim_engine.constrained import SchemaError
from services.sim_engine.disagg import DecodeRooms, KVPoll, LinkQueue, PrefillRooms, Timeouts
from services.sim_engine.request import LoadSnapshot, Request, RequestUpdate
from services.sim_engine.sampling import SamplingParams
from services.sim_engine.scripted import scripted_output


def finished(request: Request, tokens: int) -> RequestUpdate:
    return RequestUpdate(request, "ab", tokens, {"type": "length", "length": tokens})


# ---------------------------------------------------------------------------------- /generate


def test_a_generate_payload_carries_sglangs_meta_info_and_the_ids_so_far():
    request = Request(rid="r", input_ids=[1, 2, 3], output_ids=[7, 8, 9], cached_tokens=2)
    payload = reports.generate_payload(request, finished(request, 2), None)
    assert payload == {"text": "ab", "output_ids": [7, 8], "meta_info": {
        "id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3,
        "completion_tokens": 2, "cached_tokens": 2}}
    final = reports.generate_payload(request, finished(request, 2), 0.25)
    assert list(final["meta_info"])[-1] == "e2e_latency" and final["meta_info"]["e2e_latency"] == 0.25


def test_logprobs_are_cumulative_and_their_text_is_each_token_decoded_alone():
    request = Request(rid="r", input_ids=[1], output_ids=[7, 8], return_logprob=True)
    request.token_logprobs = [(-0.1, 7, " a"), (-0.2, 8, " b")]
    request.top_logprobs = [[(-0.1, 7, " a")], [(-0.2, 8, " b")]]
    meta = reports.generate_payload(request, finished(request, 1), None)["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.1, 7, " a"]]
    assert meta["output_top_logprobs"] == [[[-0.1, 7, " a"]]]
    alone = reports.generate_payload(request, finished(request, 2), None, lambda token_id: f"t{token_id}")
    assert alone["meta_info"]["output_token_logprobs"] == [[-0.1, 7, "t7"], [-0.2, 8, "t8"]]


# ---------------------------------------------------------------------------------- info endpoints


def test_server_info_reports_flags_as_given_and_the_longest_prompt_the_scheduler_takes():
    config = EngineConfig(context_length=4096)
    info = reports.server_info(config, capacity_tokens=2000, time_scale=0.5, eval_accuracy=0.9)
    assert info["version"] == reports.SGLANG_VERSION and info["inferbus_simulated"] is True
    assert info["max_running_requests"] is None  # SGLang's flag, unset
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == config.max_running_requests
    assert info["max_total_num_tokens"] == 2000
    assert info["max_req_input_len"] == 2000 - 6  # min(context length, KV pool) - 6
    assert info["time_scale"] == 0.5 and info["sim_eval_accuracy"] == 0.9


def test_model_info_and_loads_have_sglangs_shape():
    config = EngineConfig(model="m")
    assert reports.model_info(config) == {"model_path": "m", "tokenizer_path": "m", "is_generation": True}
    snapshot = LoadSnapshot(1, 2, 30, 100, 0.3, 0.5, 8)
    assert reports.loads(snapshot, 12.5) == {
        "timestamp": 12.5, "version": reports.SGLANG_VERSION, "dp_rank_count": 1,
        "loads": [{"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 2, "num_used_tokens": 30,
                   "max_total_num_tokens": 100, "token_usage": 0.3, "cache_hit_rate": 0.5,
                   "max_running_requests": 8}]}


# ---------------------------------------------------------------------------------- prefill/decode


def test_the_prefill_layout_is_sglangs_with_the_engines_page_and_port():
    layout = pd_reports.prefill_layout(EngineConfig(block_size=32, port=31000, kv_cache_dtype="fp8_e4m3"))
    assert layout["page_size"] == 32 and layout["prefill_http_port"] == 31000
    assert layout["kv_cache_dtype"] == "fp8_e4m3" and layout["follow_bootstrap_room"] is True
    assert layout["target_tp_rank"] is None  # each decode engine fills it in for itself


def test_server_info_of_a_pd_engine_reports_mooncake_tcp_as_sglang_resolves_it():
    config = EngineConfig(disaggregation_transfer_backend="mooncake_tcp", disaggregation_mode="decode")
    fields = pd_reports.server_info(config, "decode", 50.0)
    assert fields["disaggregation_mode"] == "decode"
    assert fields["disaggregation_transfer_backend"] == "mooncake"
    # A decode engine runs without the radix cache unless told otherwise, as SGLang.
    assert fields["disable_radix_cache"] is True and fields["kv_transfer_bandwidth_gb_s"] == 50.0


def test_pd_queues_count_waiting_rooms_as_waiting_requests():
    prefill = PrefillRooms(Timeouts(), LinkQueue(KV_LINKS["rdma"], 1, LLAMA_70B))
    prefill.open(1, "a", now=0.0)  # bootstrapping: waits for its destination
    decode = DecodeRooms(Timeouts())
    decode.open(2, "b", "p:1", 100, 0.0)  # bootstrapping: the handshake
    decode.open(3, "c", "q:1", 100, 0.0)
    decode.handshake("q:1", "tcp://q:9")  # waiting for KV room
    queues = pd_reports.pd_queues(prefill, decode)
    assert queues == pd_reports.PdQueues(prefill_bootstrap=1, prefill_inflight=0, decode_prealloc=2,
                                         decode_transfer=0)
    assert decode.count(KVPoll.WAITING_FOR_INPUT) == 1
    loads = reports.loads(LoadSnapshot(0, 1, 0, 100, 0.0, 0.0, 8), 1.0)
    out = pd_reports.with_disaggregation(loads, "decode", queues, retracted=1, last_transfer=(0.002, 4e7))
    load = out["loads"][0]
    assert load["num_waiting_reqs"] == 1 + 1 + 2 + 0
    assert list(load)[-1] == "disaggregation"
    assert load["disaggregation"]["decode_retracted_queue_reqs"] == 1
    assert load["disaggregation"]["kv_transfer_latency_ms"] == pytest.approx(2.0)
    assert load["disaggregation"]["kv_transfer_speed_gb_s"] == pytest.approx(20.0)
    assert loads["loads"][0]["num_waiting_reqs"] == 1  # the aggregated payload is left as it was


def test_no_transfer_yet_reports_zero_speed_and_latency():
    loads = reports.loads(LoadSnapshot(0, 0, 0, 100, 0.0, 0.0, 8), 1.0)
    section = pd_reports.with_disaggregation(loads, "prefill", pd_reports.PdQueues(0, 0, 0, 0), 0, None)
    assert section["loads"][0]["disaggregation"]["kv_transfer_speed_gb_s"] == 0.0
    assert section["loads"][0]["disaggregation"]["kv_transfer_latency_ms"] == 0.0


# ---------------------------------------------------------------------------------- scripted output


def test_a_json_schema_request_gets_a_value_of_the_schema_whatever_the_prompt():
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    sampling = SamplingParams(json_schema=schema, sampling_seed=1)
    output = scripted_output("What is 2 + 3?", [1, 2], sampling, "r", lambda: 1.0, "llama3")
    assert output is not None and isinstance(json.loads(output)["n"], int)
    with pytest.raises(SchemaError):
        scripted_output("", [1], SamplingParams(json_schema="{"), "r", lambda: 1.0, "llama3")


def test_an_arithmetic_question_is_answered_with_the_models_accuracy():
    asked: list[bool] = []

    def accuracy() -> float:
        asked.append(True)
        return 1.0

    assert scripted_output("What is 2 + 3?", [1], SamplingParams(), "r", accuracy, "llama3") == "5"
    assert asked == [True]
    assert scripted_output("Hello there", [1], SamplingParams(), "r", accuracy, "llama3") is None


def test_a_regex_constraint_leaves_the_output_to_the_steps():
    def never() -> float:
        raise AssertionError("the accuracy is read only when an answer is looked for")

    assert scripted_output("What is 2 + 3?", [1], SamplingParams(regex="[0-9]+"), "r", never, "llama3") is None
