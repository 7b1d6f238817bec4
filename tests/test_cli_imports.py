"""A service process imports its service, not the whole command line: `inferbus worker` (and each
other service) once imported the planner, the simulators and the openai SDK, 2 s of CPU in every
platform process at start (README, "Test tiers")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

# What no service needs: the operators' and planners' commands and what they pull in.
NOT_FOR_SERVICES = ("openai", "tools.capacity", "tools.drill", "tools.commands.plan", "tools.commands.billing",
                    "tools.commands.releases", "tools.commands.tenants")


def imported_by(*argv: str) -> set[str]:
    script = (
        "import json, sys\n"
        "from tools.commands.main import main\n"
        f"main({list(argv)!r}, standalone_mode=False)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.splitlines()[-1]))


@pytest.mark.parametrize("service", ["worker", "router", "sim-engine"])
def test_a_service_command_imports_no_operator_command(service: str) -> None:
    unwanted = {name for name in imported_by(service, "--help")
                if any(name == top or name.startswith(top + ".") for top in NOT_FOR_SERVICES)}
    assert not unwanted


def test_an_operator_command_is_imported_when_it_runs() -> None:
    assert "tools.commands.plan" in imported_by("plan", "--help")
