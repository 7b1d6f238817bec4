"""A worker killed just after it took a request from the queue, before its `Accepted` reached the
gateway: the message is acked, so the router has nothing to move, and the gateway still thinks the
request waits in a queue. The request must still be answered, and billed once.

The worker's fault point (`INFERBUS_FAULT_HOLD=after_ack`) stops the first worker to get there and
writes a file naming it; the test SIGKILLs that worker, either starting it again at once under its
id (within its heartbeat's TTL: the gateway sees a new process, not a lapse) or leaving it dead.
The prompt is shorter than a prefix block, so the gateway queues it on the shared subject without
asking the router: it never knows which worker took it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from services.worker.fault_hold import marker_path

from .conftest import Platform, running_platform
from .fault_points import kill_the_held, stream_in_background, whole_answer
from .ledger import ledger, new_tenant, rollup_drained, rollups_by_key
from .service_logs import log_events
from .waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    # A heartbeat TTL longer than a worker's restart, so that a restart is seen as one (a worker's
    # start takes seconds on a loaded machine: imports, its engine's connection, the bus).
    with running_platform(tmp_path_factory.mktemp("taken-window"), workers=2, time_scale=0.1,
                          extra_env={"INFERBUS_FAULT_HOLD": "after_ack", "INFERBUS_HEARTBEAT_INTERVAL_S": "0.5",
                                     "INFERBUS_HEARTBEAT_TTL_S": "12", "INFERBUS_ACCEPT_TIMEOUT_S": "2"}) as running:
        yield running


@pytest.mark.parametrize("restart", [True, False], ids=["restarted-at-once", "left-dead"])
def test_a_request_whose_worker_died_after_taking_it_is_answered_elsewhere(platform: Platform,
                                                                            restart: bool) -> None:
    # The next request to reach the point holds there.
    marker_path(platform.stack.config.state_dir / "state", "after_ack").unlink(missing_ok=True)
    tenant, [(secret, key_id)] = new_tenant(platform)
    # No retries, and a timeout far below the request's own deadline: the answer must come from
    # the platform moving the request, not from waiting it out.
    client = openai.OpenAI(base_url=platform.base_url, api_key=secret, max_retries=0, timeout=30)
    started = time.time()
    reader, got = stream_in_background(client, "taken", max_tokens=16)
    held, victim = kill_the_held(platform, "after_ack")
    if restart:
        victim.start()

    usage = whole_answer(reader, got, held, tokens=16)[-1].usage

    gateway_log = platform.stack.config.state_dir / "logs" / "gateway.log"
    moved = [e for e in log_events(gateway_log, "request_not_started") if e["request_id"] == held["request_id"]]
    assert moved, "the gateway did not move the request"
    seen = log_events(gateway_log, "worker_restarted" if restart else "worker_gone")
    assert any(e["worker_id"] == held["worker_id"] for e in seen), seen

    # The killed process ran nothing: one report, the answering worker's.
    wait_for(lambda: rollup_drained(platform), timeout=30, what="billing to roll the ledger up")
    billed = [e for e in ledger(platform, tenant) if e.billed_to == "tenant"]
    assert [(e.request_id, e.usage.completion_tokens) for e in billed] == [(held["request_id"], 16)], billed
    assert rollups_by_key(platform, tenant, started, time.time()) == {key_id: {
        "requests": 1, "input": usage.prompt_tokens, "output": 16, "cached": billed[0].usage.cached_tokens}}
    if not restart:
        victim.start()  # as `inferbus up` would
