"""Failure drills on the 3-zone local platform (`inferbus up --zones 3`), each through
`inferbus drill KIND`: under load, one part breaks; no accepted request and no usage event may be
lost or double counted, fewer than 0.1% of requests may end in a 5xx after the clients' own
retries, and service must be restored within the stated time.

Their own suite (about 3.5 minutes on 2 cores): `make test-drills`, or INFERBUS_DRILLS=1 pytest -m drill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferbus.local.ports import free_port

from .local_up import inferbus_up

pytestmark = [
    pytest.mark.e2e, pytest.mark.drill,
    pytest.mark.skipif(not os.environ.get("INFERBUS_DRILLS"), reason="the drill suite: make test-drills"),
]

# Seconds from the fault until service is restored, per kind: a killed process comes back after the
# launcher's 1 s backoff and its start-up; a hung worker after --hang; a dead GPU after the hang
# verdict (5 s here) and its replica's restart; a zone after all of that at once.
RECOVER_WITHIN_S = {
    "worker-kill": 20, "worker-hang": 25, "gpu-death": 40, "router-kill": 20, "billing-kill": 20,
    "nats-node-kill": 25, "redis-failover": 25, "zone-loss": 45,
}


@pytest.fixture(scope="module")
def zones(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    state = tmp_path_factory.mktemp("zones") / "state"
    with inferbus_up(state, "--zones", "3", "--workers", "3", "--port", str(free_port()),
                     "--time-scale", "0.1", ready_within_s=330) as running:
        yield running


# Drills whose fault must hit requests in flight on the broken workers (`inferbus drill` breaks them
# at a moment their engines hold requests), and show it: streams continued on other workers, or
# requests their clients sent again. A zone's gateway goes down with its workers (the router keeps
# a gateway's requests in its zone).
HITS_LIVE_WORK = {"worker-kill": "migrated", "worker-hang": "migrated", "gpu-death": "migrated",
                  "zone-loss": "migrated or retried"}


@pytest.mark.parametrize("kind", list(RECOVER_WITHIN_S))
def test_drill(zones: Path, kind: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tools.commands.main", "drill", kind, "--state-dir", str(zones), "--duration", "20",
         "--fault-at", "4", "--clients", "4", "--recover-within", str(RECOVER_WITHIN_S[kind]), "--json"],
        capture_output=True, text=True, timeout=180,
    )
    assert result.stdout, result.stderr
    report = json.loads(result.stdout)
    print(kind, json.dumps(report))
    assert report["sent"] > 20 and report["completed"] > 0, report
    assert report["usage_lost"] == 0 and report["usage_duplicated"] == 0 and report["usage_mismatched"] == 0, report
    assert report["within_budget"], report
    assert report["recovered_after_s"] is not None and report["recovered_after_s"] <= RECOVER_WITHIN_S[kind], report
    assert result.returncode == 0, result.stderr
    if kind in HITS_LIVE_WORK:
        assert report["in_flight_at_fault"], report
        mattered = report["migrated"] + (report["retried"] if HITS_LIVE_WORK[kind] == "migrated or retried" else 0)
        assert mattered > 0, report
