"""The routing benchmark's reading of Dynamo's frontend log and its tokenizer for the trace's prompts."""

from __future__ import annotations

from pathlib import Path

from bench.dynamo_live import request_records, write_model_dir
from tools.capacity import traces

# Two requests as Dynamo 1.6.1's frontend logs them (ANSI colours included), in KV mode.
LOG = (
    "\x1b[2m2026-12-02T05:48:34.866120Z\x1b[0m \x1b[32m INFO\x1b[0m dynamo_kv_router::scheduling::selector: Selected "
    "worker "
    'router_mode="kv" request_id="81845324-29e2-48cf-8839-e4688e4679bf" worker_id=9164134428176026417 logit=30.625\n'
    "2026-12-02T05:48:34.949156Z  INFO http-request:completions:kv_router.route_request: request_span: route request "
    'completed request.outcome="success" request_id=2dd9434f-8f1f-41fd-98c0-ee4fd10cba78 otel.kind="client" '
    "request_id=81845324-29e2-48cf-8839-e4688e4679bf dp_rank=0 overlap_blocks=0 phase=Aggregated\n"
    "2026-12-02T05:48:34.949279Z  INFO http-request:completions: dynamo_llm::http::service::metrics: request completed "
    "request_id=81845324-29e2-48cf-8839-e4688e4679bf model=m endpoint=completions status=success "
    "request_id=2dd9434f-8f1f-41fd-98c0-ee4fd10cba78 input_tokens=1000 output_tokens=5 ttft_ms=\"47.00\" "
    "avg_itl_ms=\"9.32\" prefill_worker_id=9164134428176026417 decode_worker_id=9164134428176026417\n"
    "2026-12-02T05:48:34.999838Z  INFO http-request:completions:kv_router.route_request: request_span: route request "
    'completed request.outcome="success" request_id=cb96d355-d620-421a-ba33-f9ee79c0400f otel.kind="client" '
    "request_id=58cec54d-9662-493e-be2e-7d0a1570cd90 dp_rank=0 overlap_blocks=15 phase=Aggregated\n"
    "2026-12-02T05:48:34.999907Z  INFO http-request:completions: dynamo_llm::http::service::metrics: request completed "
    "request_id=58cec54d-9662-493e-be2e-7d0a1570cd90 model=m request_id=cb96d355-d620-421a-ba33-f9ee79c0400f "
    "input_tokens=1000 output_tokens=5 ttft_ms=\"12.08\" decode_worker_id=517137411502172675\n"
)


def test_request_records_join_the_routing_and_completion_lines_by_request_id(tmp_path: Path) -> None:
    log = tmp_path / "frontend.log"
    log.write_text(LOG)
    records = request_records(log)
    assert records == {
        "81845324-29e2-48cf-8839-e4688e4679bf": {"overlap_blocks": 0, "worker": "9164134428176026417",
                                                 "input_tokens": 1000, "output_tokens": 5, "ttft_ms": 47.0},
        "58cec54d-9662-493e-be2e-7d0a1570cd90": {"overlap_blocks": 15, "worker": "517137411502172675",
                                                 "input_tokens": 1000, "output_tokens": 5, "ttft_ms": 12.08},
    }


def test_word_level_tokenizer_gives_the_trace_token_count(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    write_model_dir(tmp_path, 131_072)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for request in (traces.TraceRequest(0.0, 1300, 1, (3, 4, 5)), traces.TraceRequest(0.0, 512, 1, (9,))):
        ids = tokenizer.encode(traces.mooncake_prompt(request)).ids
        assert len(ids) == request.input_tokens
        assert 0 not in ids  # no unknown words
