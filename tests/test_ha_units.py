"""Pure parts of high availability: Sentinel URLs, the local cluster's configs, NATS server lists,
and a drill's report from what clients saw and what the ledger holds."""

from __future__ import annotations

import pytest

from inferbus.bus.connection import server_list
from inferbus.local import cluster as lc
from inferbus.runtime.redis_conn import parse_sentinel_url, redact, sentinel_url
from tools.drill.report import Attempt, Call, LedgerEvent, summarize


def test_sentinel_urls_round_trip_and_plain_urls_are_not_sentinel() -> None:
    url = sentinel_url([("10.0.0.1", 26379), ("redis-1.redis-headless", 26380)], "inferbus", "s3cret", db=2)
    parsed = parse_sentinel_url(url)
    assert parsed is not None
    assert parsed.sentinels == (("10.0.0.1", 26379), ("redis-1.redis-headless", 26380))
    assert (parsed.service, parsed.db, parsed.password) == ("inferbus", 2, "s3cret")
    assert "s3cret" not in redact(url)
    assert parse_sentinel_url("redis://:pw@127.0.0.1:6379/0") is None
    with pytest.raises(ValueError, match="names no service"):
        parse_sentinel_url("redis+sentinel://127.0.0.1:26379")
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_sentinel_url("redis+sentinel://127.0.0.1/inferbus")


def test_nats_url_lists_every_node_and_each_zone_puts_its_own_first() -> None:
    assert server_list("nats://a:1, nats://b:2,") == ["nats://a:1", "nats://b:2"]
    urls = ["nats://a", "nats://b", "nats://c"]
    assert lc.preferred_first(urls, 1) == "nats://b,nats://c,nats://a"
    zones = lc.zone_names(3)
    assert [lc.worker_zone(i, zones) for i in range(1, 6)] == ["a", "b", "c", "a", "b"]


def test_each_node_routes_to_the_others_with_the_route_user() -> None:
    layout = lc.ClusterLayout([lc.NatsNode(z, 4000 + i, 5000 + i, 6000 + i) for i, z in enumerate("abc")], "pw")
    block = lc.nats_cluster_block(layout, layout.nodes[0])
    assert 'server_name: "nats-a"' in block and '"nats-route://route:pw@127.0.0.1:6001"' in block
    assert ":6000\"" not in block.split("routes:")[1]  # not to itself
    assert "tls" not in block
    paths = tuple(__import__("pathlib").Path(f"/state/tls/{name}") for name in ("n.pem", "n.key", "ca.pem"))
    secured = lc.nats_cluster_block(layout, layout.nodes[0], paths)  # routes under TLS, verified by the CA
    assert 'tls { cert_file: "/state/tls/n.pem", key_file: "/state/tls/n.key", ca_file: "/state/tls/ca.pem"' in secured
    assert secured.rstrip().endswith("}") and secured.count("{") == secured.count("}")
    sentinel = lc.sentinel_config(26379, 6379, "pw", __import__("pathlib").Path("/tmp"))
    assert "sentinel monitor inferbus 127.0.0.1 6379 2" in sentinel and "requirepass pw" in sentinel
    assert lc.redis_replication_lines("pw", 6379) == "masterauth pw\nreplicaof 127.0.0.1 6379\n"


def call(*attempts: Attempt) -> Call:
    return Call(list(attempts))


def test_a_drill_report_counts_failures_after_retries_and_checks_the_ledger() -> None:
    ok = call(Attempt("r1", 200, 1.0, 1.5, completion_tokens=10))
    retried = call(Attempt("r2", 503, 5.0, 5.1), Attempt("r3", 200, 5.5, 6.0, completion_tokens=7))
    failed = call(Attempt("r4", 503, 6.0, 6.1), Attempt("", 0, 6.5, 6.6))
    lost = call(Attempt("r5", 200, 7.0, 7.5, completion_tokens=3))
    wrong = call(Attempt("r6", 200, 8.0, 8.5, completion_tokens=4))
    ledger = [
        LedgerEvent("r1", 10, 5, "completed"),
        LedgerEvent("r3", 7, 5, "completed"),
        LedgerEvent("r6", 5, 5, "completed"),
        LedgerEvent("r2", 0, 0, "failed", "w.worker-1"),
        LedgerEvent("r2", 0, 0, "failed", "w.worker-1"),  # one reporter twice: a duplicate
        # A killed worker's report, delivered when it came back, and its successor's: one bill.
        LedgerEvent("r1", 10, 5, "completed", "w.worker-2"),
    ]
    report = summarize(
        "worker-kill", [ok, retried, failed, lost, wrong], ledger, fault_at=4.0, ready_at=9.0, migrated=2
    )
    assert (report.sent, report.completed, report.retried) == (5, 4, 2)
    assert report.failed_by_status == {"connection": 1}
    assert report.error_ratio == pytest.approx(1 / 5) and not report.within_budget
    assert (report.usage_lost, report.usage_duplicated, report.usage_mismatched) == (1, 1, 1)
    assert report.recovered_after_s == pytest.approx(5.0)  # ready at 9 s; troubled requests started before
    assert not report.ok(max_recovery_s=60)
    assert any("5xx ratio" in line and "OVER" in line for line in report.lines())


def test_recovery_waits_for_the_last_request_that_needed_a_retry() -> None:
    late = call(Attempt("r1", 503, 12.0, 12.1), Attempt("r2", 200, 12.5, 13.0, completion_tokens=1))
    report = summarize("zone-loss", [late], [LedgerEvent("r2", 1, 1, "completed")], fault_at=4.0, ready_at=6.0,
                       migrated=0)
    assert report.recovered_after_s == pytest.approx(8.0)
    assert report.ok(max_recovery_s=10) and not report.ok(max_recovery_s=5)
    assert summarize("x", [late], [], fault_at=4.0, ready_at=None, migrated=0).recovered_after_s is None


def test_drill_clients_wait_as_long_as_the_server_asks_like_the_openai_sdk() -> None:
    from tools.drill.run import retry_wait

    assert retry_wait(0, 5.0) == 5.0  # a 503 "no capacity" says retry-after 5: the SDK waits 5 s
    assert retry_wait(3, 1.0) == 1.0
    assert [retry_wait(n, 0.0) for n in range(5)] == [0.25, 0.5, 1.0, 2.0, 2.0]  # no header: backoff
    assert retry_wait(1, 600.0) == 0.5  # beyond what the SDK honours: its own backoff
