"""Failure drills on a disaggregated platform (`inferbus up --prefill 2 --decode 2`), each through
`inferbus drill KIND`: a prefill worker killed with its engine while it computes or sends a
prompt's KV (its halves are tried again on the other prefill worker before any token was sent),
a decode worker killed with its engine mid-stream (its streams migrate, as on an aggregated fleet).
No accepted request and no usage event may be lost or double counted, and fewer than 0.1% of
requests may end in a 5xx after the clients' own retries.

Part of the drill suite: `make test-drills`, or INFERBUS_DRILLS=1 pytest -m drill.
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

# Seconds from the fault until service is restored: the launcher restarts the pod's two processes
# after its 1 s backoff; meanwhile the other worker of the role serves.
RECOVER_WITHIN_S = {"prefill-kill": 20, "decode-kill": 20}


@pytest.fixture(scope="module")
def disaggregated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    state = tmp_path_factory.mktemp("pd") / "state"
    # Real GPU speed: a long prompt's prefill and KV transfer take long enough to be caught mid-way.
    with inferbus_up(state, "--prefill", "2", "--decode", "2", "--port", str(free_port()),
                     "--time-scale", "1", ready_within_s=180) as running:
        yield running


@pytest.mark.parametrize("kind", list(RECOVER_WITHIN_S))
def test_pd_drill(disaggregated: Path, kind: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tools.commands.main", "drill", kind, "--state-dir", str(disaggregated),
         "--duration", "20", "--fault-at", "4", "--clients", "4", "--recover-within", str(RECOVER_WITHIN_S[kind]),
         "--json"],
        capture_output=True, text=True, timeout=180,
    )
    assert result.stdout, result.stderr
    report = json.loads(result.stdout)
    print(kind, json.dumps(report))
    assert report["sent"] > 10 and report["completed"] > 0, report
    assert report["usage_lost"] == 0 and report["usage_duplicated"] == 0 and report["usage_mismatched"] == 0, report
    assert report["within_budget"], report
    assert report["recovered_after_s"] is not None and report["recovered_after_s"] <= RECOVER_WITHIN_S[kind], report
    # The fault hit live work: halves tried again on the other prefill worker, streams migrated.
    if kind == "prefill-kill":
        [note] = [n for n in report["notes"] if n.startswith("prefill halves retried")]
        assert int(note.rsplit(" ", 1)[1]) >= 1, report
    else:
        assert report["migrated"] >= 1, report
    assert result.returncode == 0, result.stderr
