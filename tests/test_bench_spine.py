"""The spine benchmark's pure parts: /proc tree CPU accounting, the SSE reading, the summary and the
targets' verdict; and its client against a small local SSE server (no timing asserted)."""

from __future__ import annotations

import asyncio
import math
import os
from pathlib import Path
from typing import Any

import pytest

from bench.spine import (
    Endpoint,
    ProcStat,
    Slice,
    closed_loop,
    completed_tokens,
    connection_role,
    count_deltas,
    cpu_ms_per_request,
    first_token_at,
    markdown,
    nats_counts,
    parse_proc_stat,
    phase_metrics,
    redis_counts,
    start_floors,
    stop_process,
    summarise,
    tree_ticks,
    verdict,
)


def test_parse_proc_stat_reads_parent_and_all_four_cpu_fields_past_a_command_name_with_parentheses() -> None:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime ...
    line = "4242 (python (x) y) S 17 4242 4242 0 -1 4194304 100 0 0 0 250 40 7 3 20 0 5 0 123 0\n"
    assert parse_proc_stat(line) == ProcStat(ppid=17, ticks=250 + 40 + 7 + 3)


def test_tree_ticks_adds_every_live_descendant_once_and_nothing_else() -> None:
    procs = {
        1: ProcStat(0, 1000),  # init: not in the tree
        10: ProcStat(1, 5),  # the root
        11: ProcStat(10, 7),  # its child
        12: ProcStat(11, 11),  # a grandchild
        13: ProcStat(10, 0),
        20: ProcStat(1, 300),  # a sibling of the root's: not in the tree
        21: ProcStat(20, 50),
    }
    assert tree_ticks(procs, 10) == 5 + 7 + 11 + 0
    assert tree_ticks(procs, 12) == 11
    assert tree_ticks(procs, 99) == 0  # gone


def test_a_child_reaped_during_the_window_is_counted_once_through_its_parent() -> None:
    before = {10: ProcStat(1, 100), 11: ProcStat(10, 40)}
    # The child used 10 more ticks and exited; the parent reaped it (its 50 ticks now in cutime).
    after = {10: ProcStat(1, 100 + 5 + 50)}
    used = tree_ticks(after, 10) - tree_ticks(before, 10)
    assert used == 5 + 10


def test_cpu_ms_per_request_divides_each_trees_ticks_by_requests() -> None:
    before = {"gateway": 100, "worker": 50, "gone": 1}
    after = {"gateway": 300, "worker": 60}
    result = cpu_ms_per_request(before, after, requests=1000, clk_tck=100)
    assert result == {"gateway": 2.0, "worker": 0.1}  # 200 ticks = 2 s over 1000 requests
    assert cpu_ms_per_request({"x": 0}, {"x": 100}, 0, clk_tck=100) == {"x": 1000.0}  # no division by zero


def test_first_token_skips_the_role_only_chunk_and_reads_both_json_spacings() -> None:
    role_only = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    assert not first_token_at(role_only)
    assert first_token_at(role_only + b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n')
    assert first_token_at(b'data: {"choices": [{"delta": {"role": "assistant", "content": " the"}}]}\n\n')
    body = role_only + b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    assert not first_token_at(body, start=len(body))  # scanning starts where the last read ended


def test_completed_tokens_needs_the_done_line_and_reads_the_last_usage() -> None:
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":20,"completion_tokens":16,"total_tokens":36}}\n\n'
    assert completed_tokens(usage + b"data: [DONE]\n\n") == 16
    assert completed_tokens(usage) is None  # cut off before the end
    assert completed_tokens(b'data: {"choices":[],"usage":null}\n\ndata: [DONE]\n\n') is None


def test_phase_metrics_pools_the_slices_samples_and_sums_their_counters() -> None:
    slices = [
        Slice(ttfb_ms=[1.0, 2.0], e2e_ms=[5.0, 6.0], requests=100, errors=0, first_error="", wall=1.0,
              ticks={"gateway": 10, "worker": 5, "engine": 20, "sglang-router": 1}, client_seconds=0.02,
              machine_seconds=1.0),
        Slice(ttfb_ms=[3.0], e2e_ms=[7.0], requests=300, errors=2, first_error="HTTP 500", wall=1.0,
              ticks={"gateway": 30, "worker": 15, "engine": 60, "sglang-router": 1}, client_seconds=0.06,
              machine_seconds=1.9),
    ]
    m = phase_metrics("inferbus", slices, clk_tck=100)
    assert m["requests"] == 400 and m["errors"] == 2 and m["first_error"] == "HTTP 500"
    assert m["req_per_s"] == 200.0
    assert m["ttfb_p50_ms"] == 2.0 and m["e2e_p99_ms"] == 7.0
    assert m["cpu_ms_per_request"] == {"gateway": 1.0, "worker": 0.5, "engine": 2.0, "sglang-router": 0.05}
    assert m["own_cpu_ms_per_request"] == 1.5  # gateway + worker; not the engine, not the other router
    assert math.isclose(m["client_cpu_ms_per_request"], 0.2)
    assert math.isclose(m["others_idle_cores"], 0.01)  # sglang-router's 2 ticks over 2 s
    # 2.9 busy seconds - 1.42 measured - 0.08 client, over 2 s
    assert math.isclose(m["other_load_cores"], (2.9 - 1.42 - 0.08) / 2)


def phase(scenario: str, rep: int, system: str, **values: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"scenario": scenario, "rep": rep, "system": system, "concurrency": 64, "requests": 100,
                            "errors": 0, "req_per_s": 1000.0, "ttfb_p50_ms": 1.0, "ttfb_p99_ms": 2.0, "e2e_p50_ms": 3.0,
                            "own_cpu_ms_per_request": 0.0, "client_cpu_ms_per_request": 0.3, "other_load_cores": 0.0,
                            "cpu_ms_per_request": {"engine": 1.0}}
    return {**base, **values}


def test_summary_adds_ttfb_over_the_engine_of_the_same_rep_and_averages_reps() -> None:
    phases = [
        phase("c64", 0, "engine", ttfb_p50_ms=1.0, ttfb_p99_ms=5.0),
        phase("c64", 0, "inferbus", ttfb_p50_ms=3.0, ttfb_p99_ms=9.0, own_cpu_ms_per_request=1.0,
              cpu_ms_per_request={"gateway": 0.6, "worker": 0.4, "engine": 1.0}),
        phase("c64", 1, "inferbus", ttfb_p50_ms=6.0, ttfb_p99_ms=20.0, own_cpu_ms_per_request=2.0,
              cpu_ms_per_request={"gateway": 1.0, "worker": 1.0, "engine": 1.2}),
        phase("c64", 1, "engine", ttfb_p50_ms=2.0, ttfb_p99_ms=4.0),
    ]
    s = summarise(phases)["c64"]["inferbus"]
    assert s["added_ttfb_p50_ms_reps"] == [2.0, 4.0]
    assert s["added_ttfb_p50_ms"] == 3.0
    assert s["added_ttfb_p99_ms"] == (4.0 + 16.0) / 2
    assert s["own_cpu_ms_per_request"] == 1.5
    assert s["cpu_ms_per_request"] == {"gateway": 0.8, "worker": 0.7, "engine": 1.1}
    assert "added_ttfb_p50_ms" not in summarise(phases)["c64"]["engine"]


def test_verdict_marks_each_target_and_gives_no_ratio_over_a_value_within_noise_of_zero() -> None:
    phases = []
    for system, c1_ttfb, cpu, rps, paced_p50, paced_p99 in (
        ("engine", 1.0, 0.0, 3000.0, 20.0, 30.0),
        ("sglang-router", 1.3, 0.2, 2800.0, 20.02, 31.0),
        ("inferbus", 2.0, 0.5, 2600.0, 22.0, 45.0),
    ):
        phases += [phase("c1", 0, system, ttfb_p50_ms=c1_ttfb),
                   phase("c64", 0, system, own_cpu_ms_per_request=cpu, req_per_s=rps),
                   phase("paced64", 0, system, ttfb_p50_ms=paced_p50, ttfb_p99_ms=paced_p99)]
    rows = {r["what"]: r for r in verdict(summarise(phases))}
    c1 = rows["added TTFB p50, C=1"]
    assert c1["met"] and math.isclose(c1["inferbus"], 1.0) and math.isclose(c1["ratio_to_sglang_router"], 1.0 / 0.3)
    cpu = rows["whole-platform CPU-ms per request, C=64"]
    assert cpu["met"] and math.isclose(cpu["ratio_to_sglang_router"], 2.5)
    assert rows["req/s, C=64"]["met"]  # higher is better
    assert rows["req/s, C=64"]["engine_alone"] == 3000.0
    paced_p50 = rows["paced added TTFB p50, C=64"]
    assert paced_p50["met"] and math.isnan(paced_p50["ratio_to_sglang_router"])  # sglang adds 0.02 ms
    assert not rows["paced added TTFB p99, C=64"]["met"]  # 15 ms > 10 ms


def test_markdown_shows_every_target_and_scenario() -> None:
    phases = [
        phase(sc, 0, sy, label=sc) for sc in ("c1", "c64", "paced64") for sy in ("engine", "sglang-router", "inferbus")
    ]
    summary = summarise(phases)
    results = {"when": "now", "machine": {"cpus": 2}, "command": "python -m bench.spine", "sglang_router": "0.3.2",
               "config": {"output_tokens": 16, "reps": 1, "seconds": 4.0, "warmup": 1.0}, "phases": phases,
               "client_check": [], "summary": summary, "targets": verdict(summary)}
    text = markdown(results)
    assert text.count("**missed**") + text.count("| met |") == 5
    assert "| paced64 | inferbus |" in text
    assert "busy with other work" not in text
    for p in phases:
        p["other_load_cores"] = 1.2
    assert "busy with other work**: 1.20 cores" in markdown(results)


def test_a_target_is_met_only_when_every_rep_meets_it() -> None:
    phases = [phase("c1", 0, "engine", ttfb_p50_ms=5.0), phase("c1", 0, "inferbus", ttfb_p50_ms=4.0),  # -1 ms: noise
              phase("c1", 1, "engine", ttfb_p50_ms=1.0), phase("c1", 1, "inferbus", ttfb_p50_ms=4.0)]  # +3 ms
    row = verdict(summarise(phases))[0]
    assert row["inferbus"] == 1.0 and row["reps"] == [-1.0, 3.0]
    assert not row["met"]  # the mean (1 ms) is under 1.5 ms, the second rep is not


def test_verdict_on_a_run_without_the_scenario_is_missed_not_met() -> None:
    rows = verdict(summarise([phase("c1", 0, "engine"), phase("c1", 0, "inferbus")]))
    assert not rows[1]["met"] and math.isnan(rows[1]["inferbus"])


async def sse_server(tokens: int, pause: float = 0.0) -> tuple[asyncio.Server, int]:
    """An HTTP/1.1 keep-alive server answering every POST with a chunked SSE stream of `tokens` chat
    chunks, its head and each event written separately, `pause` seconds before each event."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                events = [b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n']
                events += [b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i for i in range(tokens)]
                events += [b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\n' % tokens, b"data: [DONE]\n\n"]
                for event in events:
                    await asyncio.sleep(pause)
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.slow
async def test_closed_loop_reads_streams_and_counts_cpu_of_the_named_trees() -> None:
    server, port = await sse_server(16)
    async with server:
        window = await closed_loop(Endpoint("engine", f"http://127.0.0.1:{port}/v1/chat/completions"), 4,
                                   seconds=0.5, warmup=0.1, roots={"engine": os.getpid()})
    result = phase_metrics("engine", [window])
    assert result["errors"] == 0, result["first_error"]
    assert result["requests"] > 0 and len(window.ttfb_ms) > 0
    assert all(first <= end for first, end in zip(window.ttfb_ms, window.e2e_ms))
    assert set(result["cpu_ms_per_request"]) == {"engine"}


async def test_closed_loop_counts_a_stream_with_the_wrong_token_count_as_an_error() -> None:
    server, port = await sse_server(3)
    async with server:
        result = await closed_loop(Endpoint("engine", f"http://127.0.0.1:{port}/v1/chat/completions"), 2,
                                   seconds=0.3, warmup=0.05, roots={}, quickack=False)
    # (the server streams 3 tokens, the client asks for 16)
    assert result.requests == 0 and result.errors > 0


async def test_closed_loop_counts_a_refused_connection_as_an_error() -> None:
    server, port = await sse_server(16)
    server.close()
    await server.wait_closed()  # nothing listens on the port now
    result = await closed_loop(Endpoint("engine", f"http://127.0.0.1:{port}/v1/chat/completions"), 1,
                               seconds=0.1, warmup=0.05, roots={})
    assert result.requests == 0 and result.errors > 0 and "Error" in result.first_error


async def test_closed_loop_keeps_the_requests_sent_in_the_window_that_end_after_it() -> None:
    # Each stream takes ~0.3 s (19 events 15 ms apart) and the window, from the start, 0.1 s: every
    # connection's first request is sent in it and ends after it. Counting only requests that also
    # ended in the window would leave no TTFB samples at all (with real servers: only fast ones).
    server, port = await sse_server(16, pause=0.015)
    async with server:
        window = await closed_loop(Endpoint("engine", f"http://127.0.0.1:{port}/v1/chat/completions"), 3,
                                   seconds=0.1, warmup=0.0, roots={})
    assert window.errors == 0, window.first_error
    assert len(window.ttfb_ms) == 3 and len(window.e2e_ms) == 3  # one per connection, sent in the window


def test_connections_are_named_by_the_service_behind_them() -> None:
    assert connection_role("gateway-gw-1a2b") == "gateway"
    assert connection_role("worker-1") == "worker"
    assert connection_role("worker-1-liveness") == "worker heartbeat"
    assert connection_role("billing") == "billing" and connection_role("billing-rollup") == "billing rollup"
    assert connection_role("router-7") == "router" and connection_role("batch-x") == "batch"
    assert connection_role("") == "unnamed" and connection_role("ops-cli") == "ops-cli"


def test_count_deltas_sum_connections_by_role_and_skip_one_that_closed() -> None:
    def connz(*conns: tuple[int, str, int, int]) -> dict[str, Any]:
        return {"connections": [{"cid": cid, "name": name, "in_msgs": i, "out_msgs": o, "in_bytes": 10 * i,
                                 "out_bytes": 10 * o} for cid, name, i, o in conns]}

    before = nats_counts(connz((1, "gateway-a", 100, 50), (2, "worker-1", 7, 7), (3, "batch-b", 5, 5)),
                         {"in_msgs": 1000, "out_msgs": 2000, "in_bytes": 1, "out_bytes": 2})
    # Connection 3 closed; 4, another worker connection, opened in between.
    after = nats_counts(connz((1, "gateway-a", 130, 60), (2, "worker-1", 9, 17), (4, "worker-1-liveness", 3, 1)),
                        {"in_msgs": 1100, "out_msgs": 2500, "in_bytes": 11, "out_bytes": 22})
    before.update(redis_counts({"cmdstat_evalsha": {"calls": 40, "usec": 9}, "cmdstat_get": {"calls": 3}}))
    after.update(redis_counts({"cmdstat_evalsha": {"calls": 52, "usec": 99}, "cmdstat_get": {"calls": 3},
                               "cmdstat_xadd": {"calls": 2}}))
    deltas = count_deltas(before, after)
    assert deltas["nats.gateway.in_msgs"] == 30 and deltas["nats.gateway.out_bytes"] == 100
    assert deltas["nats.worker.out_msgs"] == 10 and deltas["nats.worker heartbeat.in_msgs"] == 3
    assert not any(k.startswith("nats.batch.") for k in deltas)
    assert deltas["nats.server.in_msgs"] == 100 and deltas["nats.server.out_msgs"] == 500
    assert deltas["redis.evalsha"] == 12 and deltas["redis.get"] == 0 and deltas["redis.xadd"] == 2


def test_markdown_shows_the_counts_per_request_and_the_idle_split() -> None:
    counts = {"nats.gateway.in_msgs": 4.0, "nats.gateway.out_msgs": 6.0, "nats.server.in_msgs": 20.0,
              "nats.server.out_msgs": 25.0, "redis.evalsha": 2.5, "redis.info": 0.01}
    phases = [
        phase("c1", 0, "engine", label="C=1"),
        phase("c1", 0, "inferbus", counts_per_request=counts, req_per_s=100.0, own_cpu_ms_per_request=5.0, label="C=1"),
    ]
    summary = summarise(phases)
    assert summary["c1"]["inferbus"]["counts_per_request"]["redis.evalsha"] == 2.5
    idle = {"zero step time": {"seconds": 3.0, "cores": {"gateway": 0.02, "billing": 0.03},
                               "counts_per_second": {"nats.gateway.in_msgs": 2.0, "redis.get": 1.0}}}
    results = {"when": "now", "machine": {"cpus": 2}, "command": "python -m bench.spine", "sglang_router": "0.3.2",
               "config": {"output_tokens": 16, "reps": 1, "seconds": 4.0, "warmup": 1.0}, "phases": phases,
               "client_check": [], "summary": summary, "targets": verdict(summary), "idle": idle}
    text = markdown(results)
    assert "| gateway: published | 4.00 |" in text and "| **nats-server total in / out** | 20.00 / 25.00 |" in text
    assert "| evalsha | 2.50 |" in text and "| info |" not in text
    assert "| **total** | **0.050** |" in text
    # 0.05 idle cores over 100 req/s: 0.5 CPU-ms of each request's 5 is background.
    assert "| C=1 | 100 | 5.000 | 0.500 | 4.500 |" in text


def test_markdown_puts_the_floors_beside_the_targets() -> None:
    phases = [
        phase("c64", 0, sy, label="C=64", own_cpu_ms_per_request=cpu)
        for sy, cpu in (
            ("engine", 0.0),
            ("sglang-router", 0.4),
            ("inferbus", 1.5),
            ("python-over-jetstream", 0.9),
            ("python-over-nats", 0.7),
            ("python-relay", 0.25),
        )
    ]
    summary = summarise(phases)
    results = {"when": "now", "machine": {"cpus": 2}, "command": "python -m bench.spine", "sglang_router": "0.3.2",
               "config": {"output_tokens": 16, "reps": 1, "seconds": 4.0, "warmup": 1.0}, "phases": phases,
               "client_check": [], "summary": summary, "targets": verdict(summary)}
    text = markdown(results)
    assert (
        "| target | bound | inferbus | python-over-jetstream | python-over-nats | python-relay | sglang-router |"
        in text
    )
    assert "| whole-platform CPU-ms per request, C=64 | ≤ 0.6 CPU-ms | 1.50 | 0.90 | 0.70 | 0.25 | 0.40 |" in text
    assert "| C=64 | python-relay |" in text  # in the per-process table too


@pytest.mark.slow
async def test_the_floors_pass_the_engines_stream_through_whole(tmp_path: Path) -> None:
    # Real nats-server (with JetStream) and the three relays in their own processes, in front of a
    # stand-in engine; the client counts a stream only if it ends with its 16 tokens and [DONE].
    server, port = await sse_server(16)
    async with server:
        processes, urls = await asyncio.to_thread(start_floors, f"http://127.0.0.1:{port}", tmp_path)
        try:
            assert set(urls) == {"python-over-jetstream", "python-over-nats", "python-relay"}
            for name, url in urls.items():
                window = await closed_loop(Endpoint(name, url + "/v1/chat/completions"), 4, seconds=0.5, warmup=0.1,
                                           roots={})
                assert window.errors == 0, (name, window.first_error)
                assert window.requests >= 4, name
        finally:
            for process in reversed(processes):
                await asyncio.to_thread(stop_process, process)
