"""`inferbus sweep`: metric definitions (hand-computed), prompt token counts, CLI errors, and an
end-to-end sweep through the real command against the simulated engine's OpenAI endpoints."""

from __future__ import annotations

import csv
import json
import math
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from click.testing import CliRunner

from inferbus.tokens.blocks import count_tokens
from inferbus.tokens.blocks import standin_render_chat as render_chat
from tools.capacity.mix import MixRequest
from tools.capacity.sweep.metrics import SLO, client_verdict, knee, meets_slo, percentile, step_stats
from tools.capacity.sweep.prompts import PromptBuilder
from tools.capacity.sweep.records import ClientSample, RequestRecord
from tools.commands.main import main

IDLE_CLIENT = ClientSample(wall_s=10.0, cpu_s=1.0, loop_lags_s=[0.001] * 100, achieved_vs_target=1.0)


def record(start: float, chunks: list[float], output: int | None = None, error: str | None = None,
           end: float | None = None) -> RequestRecord:
    r = RequestRecord("chat", start, list(chunks), end if end is not None else (chunks[-1] if chunks else start))
    r.output_tokens = len(chunks) if output is None else output
    r.input_tokens = 100
    r.error = error
    return r


# ---------------------------------------------------------------- metric definitions


def test_percentile_interpolates_like_numpy_which_aiperf_uses() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert math.isnan(percentile([], 50))
    rng = random.Random(3)
    for n in (1, 2, 7, 100):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (50, 90, 99):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_step_stats_by_hand() -> None:
    records = [
        record(0.0, [0.5, 0.52, 0.54]),  # TTFT 0.5, TPOT (0.54 - 0.5) / 2 = 0.02: good
        record(0.0, [1.0, 1.1]),  # TTFT 1.0 > 0.8: not good
        record(0.2, [0.4, 0.5, 0.6]),  # TTFT 0.2, TPOT 0.1 > 0.04: not good
        record(0.3, [], error="http_500", end=0.35),
        record(0.1, [0.3]),  # one output token: no TPOT, judged on TTFT alone: good
    ]
    step = step_stats(records, IDLE_CLIENT, SLO(0.8, 0.04), concurrency=2)
    assert step["duration_s"] == pytest.approx(1.1)  # first request 0.0 → last response 1.1
    assert (step["requests"], step["completed"], step["errors"]) == (5, 4, 1)
    assert step["error_kinds"] == {"http_500": 1}
    assert step["request_rps"] == pytest.approx(4 / 1.1)
    assert step["output_tok_s"] == pytest.approx((3 + 2 + 3 + 1) / 1.1)
    assert step["input_tok_s"] == pytest.approx(400 / 1.1)
    # TTFTs 0.5, 1.0, 0.2, 0.2 → sorted 0.2, 0.2, 0.5, 1.0; p90 at position 2.7 → 0.5 + 0.7 × 0.5.
    assert step["ttft_s"]["p90"] == pytest.approx(0.85)
    assert step["ttft_s"]["mean"] == pytest.approx(0.475)
    assert step["tpot_s"]["mean"] == pytest.approx((0.02 + 0.1 + 0.1) / 3)
    # ITL pools the chunk gaps: 0.02, 0.02 | 0.1 | 0.1, 0.1.
    assert step["itl_s"]["mean"] == pytest.approx(0.068)
    assert step["e2e_s"]["p50"] == pytest.approx(0.47)  # e2e 0.54, 1.1, 0.4, 0.2 → (0.4 + 0.54) / 2
    assert step["slo_attainment"] == pytest.approx(0.5)
    assert step["goodput_rps"] == pytest.approx(2 / 1.1)
    assert step["slo_met"] is False  # p90 TTFT 0.85 > 0.8 (and an error)
    assert step["concurrency"] == 2 and step["rate_rps"] is None and step["client_limited"] is False


def test_slo_thresholds_are_inclusive_and_errors_break_slo_met() -> None:
    slo = SLO(0.8, 0.04)
    assert meets_slo(record(0.0, [0.8, 0.84]), slo)  # TTFT = 0.8 and TPOT = 0.04 exactly: good
    assert not meets_slo(record(0.0, [0.8, 0.85]), slo)
    fine = [record(i * 0.01, [i * 0.01 + 0.1, i * 0.01 + 0.12]) for i in range(999)]
    assert step_stats(fine, IDLE_CLIENT, slo)["slo_met"] is True
    one_error = fine + [record(0.0, [], error="timeout", end=1.0)]
    assert step_stats(one_error, IDLE_CLIENT, slo)["slo_met"] is False  # 1/1000 is not < 0.1%
    # TPOT uses the server's token count, not the chunk count: 3 chunks carrying 5 tokens.
    bundled = record(0.0, [0.1, 0.2, 0.3], output=5)
    assert step_stats([bundled], IDLE_CLIENT, slo)["tpot_s"]["p50"] == pytest.approx(0.2 / 4)


def test_client_verdict_flags_cpu_lag_and_shortfall() -> None:
    assert client_verdict(IDLE_CLIENT)["limited"] is False
    busy = client_verdict(ClientSample(10.0, 9.0, [0.001], 1.0))
    assert busy["limited"] and busy["detail"]["cpu_util"] == pytest.approx(0.9)
    laggy = client_verdict(ClientSample(10.0, 1.0, [0.001] * 90 + [0.05] * 10, 1.0))
    assert laggy["limited"] and laggy["detail"]["loop_lag_p99_s"] == pytest.approx(0.05)
    short = client_verdict(ClientSample(10.0, 1.0, [0.001], 0.8))
    assert short["limited"] and "achieved 80%" in short["detail"]["reasons"][0]


def test_knee_is_the_best_goodput_that_meets_the_slo_without_client_limits() -> None:
    steps = [
        {"slo_met": True, "client_limited": False, "goodput_rps": 1.0, "concurrency": 1},
        {"slo_met": True, "client_limited": False, "goodput_rps": 3.0, "concurrency": 4},
        {"slo_met": True, "client_limited": True, "goodput_rps": 5.0, "concurrency": 16},
        {"slo_met": False, "client_limited": False, "goodput_rps": 4.0, "concurrency": 32},
    ]
    assert knee(steps)["concurrency"] == 4
    assert knee(steps[3:]) is None


# ---------------------------------------------------------------- prompts


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_prompts_have_the_mix_token_counts_and_share_the_cached_prefix(endpoint: str) -> None:
    builder = PromptBuilder(endpoint, "m", seed=1)
    a = MixRequest("rag", 700, 50, 400)
    b = MixRequest("rag", 900, 50, 400)
    bodies = [json.loads(builder.prepare(r, nonce=str(i)).body) for i, r in enumerate((a, b))]
    texts = []
    for body, request in zip(bodies, (a, b)):
        assert body["max_tokens"] == 50 and body["stream"] and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True}
        text = render_chat(body["messages"]) if endpoint == "chat" else body["prompt"]
        assert count_tokens(text) == request.input_tokens
        texts.append(text)
    from inferbus.tokens.blocks import encode

    ids_a, ids_b = encode(texts[0]), encode(texts[1])
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)
    assert shared == 400  # exactly the cached tokens, template head included
    # Another class has another prefix: it shares only the chat template's head.
    other_body = json.loads(builder.prepare(MixRequest("chat", 700, 50, 400), nonce="0").body)
    ids_other = encode(render_chat(other_body["messages"]) if endpoint == "chat" else other_body["prompt"])
    assert next(i for i, (x, y) in enumerate(zip(ids_a, ids_other)) if x != y) == builder.head_tokens


# ---------------------------------------------------------------- CLI errors


@pytest.mark.parametrize(("args", "message"), [
    (["--concurrency", "0"], "expected positive integers"),
    (["--concurrency", "1,x"], "expected positive integers"),
    (["--rate", "-1"], "expected positive numbers"),
    (["--concurrency", "1", "--rate", "1"], "exactly one of --concurrency"),
    (["--concurrency", "1", "--mix", "no-such-mix"], "no mix 'no-such-mix'"),
    (["--concurrency", "1", "--url", "localhost:1"], "http:// or https://"),
    (["--concurrency", "1", "--extra-body", "[1]"], "JSON object"),
    (["--rate", "1", "--think-time-ms", "5"], "--think-time-ms applies to --concurrency"),
    (["--concurrency", "1", "--think-time-ms", "-1"], "-1"),
])
def test_bad_input_is_a_one_line_error(args: list[str], message: str) -> None:
    base = ["sweep", "--url", "http://127.0.0.1:9", "--model", "m"]
    result = CliRunner().invoke(main, base + args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_unreachable_url_is_a_one_line_error(tmp_path: Path) -> None:
    from inferbus.local.ports import free_port

    url = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(main, ["sweep", "--url", url, "--model", "m", "--concurrency", "1",
                                       "--out", str(tmp_path), "--no-progress"])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: cannot reach {url}/v1/models") and "Traceback" not in result.output


# ---------------------------------------------------------------- end to end

STEP_MS = 20.0
MODEL = "meta-llama/Llama-3.3-70B-Instruct"  # the simulated engine's default name


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    """The simulated engine with OpenAI endpoints, fixed 20 ms steps in real time."""
    from inferbus.local.ports import free_port

    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.sim_engine",
            "--log-level",
            "warning",
            "--port",
            str(port),
            "--fixed-step-ms",
            str(STEP_MS),
            "--time-scale",
            "1",
        ]
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url + "/v1/models", timeout=1).raise_for_status()
            break
        except httpx.HTTPError:
            assert process.poll() is None and time.monotonic() < deadline, "engine did not start"
            time.sleep(0.1)
    yield url
    process.terminate()
    process.wait(10)


@pytest.mark.slow
def test_sweep_end_to_end(engine: str, tmp_path: Path) -> None:
    mix = tmp_path / "mix.yaml"
    mix.write_text("name: small\nclasses:\n  - name: only\n    input_tokens: 300\n    output_tokens: 20\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, [
        "sweep", "--url", engine, "--model", MODEL, "--mix", str(mix), "--concurrency", "1,4", "--requests", "8",
        "--out", str(out), "--gpu", "H100", "--tp", "2", "--no-progress",
    ])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "sweep.json").read_text())
    assert (
        data["schema"] == "inferbus.capacity.sweep/v1" and data["mode"] == "concurrency" and data["endpoint"] == "chat"
    )
    assert data["hardware"] == {"gpu": "H100", "tp": 2, "replicas": 1}
    assert data["slo"] == {"ttft_p90_s": 0.8, "tpot_p90_s": 0.04} and data["mix"]["name"] == "small"
    steps = data["steps"]
    assert [s["concurrency"] for s in steps] == [1, 4]
    step = STEP_MS / 1000
    for s in steps:
        assert s["requests"] == s["completed"] == 8 and s["errors"] == 0
        # Token counts are the server's: 300 prompt tokens and exactly 20 output tokens each.
        assert s["input_tok_s"] * s["duration_s"] == pytest.approx(8 * 300)
        assert s["output_tok_s"] * s["duration_s"] == pytest.approx(8 * 20)
        # One token per 20 ms step; a busy machine only makes it slower, never faster.
        assert 0.9 * step <= s["tpot_s"]["p50"] <= 2.0 * step
        assert 0.9 * step <= s["itl_s"]["p50"] <= 2.0 * step
        assert s["ttft_s"]["p50"] >= 0.9 * step  # the prompt fits one prefill step
        assert s["e2e_s"]["p50"] == pytest.approx(s["ttft_s"]["p50"] + 19 * s["tpot_s"]["p50"], rel=0.2)
        for key in ("cpu_util", "loop_lag_p99_s", "achieved_vs_target"):
            assert key in s["client"]
        assert isinstance(s["client_limited"], bool) and isinstance(s["slo_met"], bool)
    # Four streams share the steps, so throughput grows with concurrency.
    assert steps[1]["request_rps"] > 2 * steps[0]["request_rps"]
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [r["concurrency"] for r in rows] == ["1", "4"] and float(rows[0]["ttft_p90_s"]) > 0
    for png in ("sweep_latency.png", "sweep_goodput.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_rate_sweep_end_to_end(engine: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(main, [
        "sweep", "--url", engine + "/v1", "--model", MODEL, "--mix", "worked-example", "--endpoint", "completions",
        "--rate", "4", "--arrival", "constant", "--requests", "6", "--warmup", "2", "--out", str(out),
        "--no-plots", "--no-progress",
        "--extra-body", '{"max_tokens": 5}',
    ])
    assert result.exit_code == 0, result.output
    (s,) = json.loads((out / "sweep.json").read_text())["steps"]
    assert (
        s["rate_rps"] == 4.0 and s["concurrency"] is None and s["requests"] == s["completed"] == 6
    )  # warm-up left out
    assert s["client"]["achieved_vs_target"] > 0.8  # six sends 0.25 s apart, on time
    assert s["output_tok_s"] * s["duration_s"] == pytest.approx(6 * 5)  # --extra-body overrides max_tokens
    assert not (out / "sweep_latency.png").exists()


@pytest.mark.slow
def test_unknown_model_is_a_one_line_error(engine: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["sweep", "--url", engine, "--model", "no-such-model", "--concurrency", "1",
                                       "--out", str(tmp_path), "--no-progress"])
    assert result.exit_code == 1 and "does not list model 'no-such-model'" in result.output
    assert "meta-llama/Llama-3.3-70B-Instruct" in result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_simulated_engine_openai_endpoints(engine: str) -> None:
    models = httpx.get(engine + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    body = {"model": "sim", "messages": [{"role": "user", "content": " hello there"}], "max_completion_tokens": 3}
    reply = httpx.post(engine + "/v1/chat/completions", json=body, timeout=10).json()
    assert reply["object"] == "chat.completion" and reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 3 and count_tokens(reply["choices"][0]["message"]["content"]) == 3
    assert reply["usage"]["prompt_tokens"] == count_tokens(render_chat(body["messages"]))
    bad = httpx.post(engine + "/v1/completions", json={"model": "sim", "prompt": "x", "max_tokens": "3"}, timeout=10)
    assert bad.status_code == 400 and "max_new_tokens" in bad.json()["error"]["message"]


@pytest.mark.slow
async def test_think_time_delays_each_users_next_request_and_is_not_a_client_shortfall(engine: str) -> None:
    from tools.capacity.sweep.loadgen import run_concurrency

    builder = PromptBuilder("completions", MODEL)
    requests = [builder.prepare(MixRequest("c", 20, 3, 0), f"think-{i}") for i in range(8)]
    async with httpx.AsyncClient(base_url=engine + "/v1") as client:
        run = await run_concurrency(client, "/completions", requests, 2, think_s=0.05)
    assert all(r.error is None for r in run.records) and len(run.records) == 8
    assert len(run.client.reissue_s) == 6  # each user's sends after its first
    assert min(run.client.reissue_s) >= 0.05 and sorted(run.client.reissue_s)[3] < 0.05 + 0.03
    # Time spent thinking counts as the loop's own: the achieved concurrency is the target's.
    assert run.client.achieved_vs_target > 0.9


@pytest.mark.slow
async def test_connections_are_reused_between_requests(engine: str) -> None:
    """Leaving a stream at [DONE] without reading the body's end closes the connection: every
    request would then pay a new TCP connect inside its TTFT."""
    from tools.capacity.sweep.loadgen import send

    builder = PromptBuilder("completions", "sim")
    async with httpx.AsyncClient(base_url=engine + "/v1") as client:
        for i in range(3):
            record = await send(client, "/completions", builder.prepare(MixRequest("c", 20, 2, 0), str(i)),
                                RequestRecord("c", time.perf_counter()))
            assert record.error is None and record.output_tokens == 2
        assert len(client._transport._pool.connections) == 1  # httpx internals: one pooled connection
