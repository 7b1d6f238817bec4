"""A worker killed in its request's last moment: after the answer's usage is written, before its
last chunk (the `Final`) leaves. The request is billed exactly once, with what the client received.

The worker's fault point (`INFERBUS_FAULT_HOLD=before_final`) stops the first worker to get there
and writes a file naming it; the test waits for that file, SIGKILLs that worker, lets the client's
stream finish (migrated to the other worker), restarts the killed worker (its outbox republishes
what it had not delivered) and reads the billing service's rollups and the ledger.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from .conftest import Platform, running_platform
from .fault_points import kill_the_held, stream_in_background, whole_answer
from .ledger import ledger, new_tenant, outbox_pending, rollup_drained, rollups_by_key
from .waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    with running_platform(tmp_path_factory.mktemp("final-window"), workers=2, time_scale=0.1,
                          extra_env={"INFERBUS_FAULT_HOLD": "before_final", "INFERBUS_HEARTBEAT_INTERVAL_S": "0.3",
                                     "INFERBUS_HEARTBEAT_TTL_S": "1.5"}) as running:
        yield running


def test_a_worker_killed_between_its_usage_and_its_final_chunk_bills_the_request_once(platform: Platform) -> None:
    tenant, [(secret, key_id)] = new_tenant(platform)
    client = openai.OpenAI(base_url=platform.base_url, api_key=secret, max_retries=0, timeout=60)
    started = time.time()
    reader, got = stream_in_background(client, "the last moment", max_tokens=40)
    held, victim = kill_the_held(platform, "before_final")

    chunks = whole_answer(reader, got, held, tokens=40)
    usage = chunks[-1].usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]

    # The killed worker comes back (as `inferbus up` would restart it) and delivers what its outbox
    # still holds; then nothing more can arrive for this request.
    victim.start()
    outbox = platform.stack.config.state_dir / "state" / f"usage-outbox-{held['worker_id']}.sqlite3"
    wait_for(lambda: outbox_pending(outbox) == 0, timeout=30, what="the killed worker's outbox to be delivered")
    wait_for(lambda: rollup_drained(platform), timeout=30, what="billing to roll the ledger up")

    # The ledger keeps each reporter's report (the killed worker's, republished, and the next
    # attempt's: their message ids differ), each with what the client received; the rollups count one.
    billed = [e for e in ledger(platform, tenant) if e.billed_to == "tenant"]
    assert {e.request_id for e in billed} == {held["request_id"]} and 1 <= len(billed) <= 2, billed
    assert {(e.usage.prompt_tokens, e.usage.completion_tokens) for e in billed} == {(usage.prompt_tokens, 40)}
    rollups = rollups_by_key(platform, tenant, started, time.time())
    assert rollups == {key_id: {"requests": 1, "input": usage.prompt_tokens, "output": 40,
                                "cached": billed[0].usage.cached_tokens}}
