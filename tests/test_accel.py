"""The fleet simulator's compiled build: used only while it matches the source, and the same results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.capacity import accel

pytestmark = pytest.mark.slow

SCENARIO = """
import json, sys
from tools.capacity import accel, mix
from tools.capacity.fleetsim.day import constant
from tools.capacity.fleetsim.fast import FastConfig, FastFleet
out = {"compiled": accel.active()}
for policy in ("least_loaded", "affinity"):
    arrivals = list(constant(50.0, 40.0, mix.load("worked-example"), seed=5))
    summary = FastFleet(FastConfig(replicas=12, policy=policy), arrivals).run()
    report = summary.as_dict(series=True)
    assert report.pop("build") == ("compiled" if out["compiled"] else "pure Python")
    for key in ("cpu_s", "wall_s", "req_per_cpu_s", "events_per_cpu_s"):
        report.pop(key, None)
    out[policy] = report
print(json.dumps(out, sort_keys=True, default=str))
"""


def run_scenario(**env: str) -> dict[str, object]:
    completed = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True, check=True,
                               cwd=accel.ROOT, env=dict(os.environ, **env))
    return json.loads(completed.stdout)


def test_the_compiled_simulator_gives_the_pure_pythons_results_to_the_last_digit() -> None:
    problem = accel.check()
    if problem is not None:
        pytest.skip(f"no compiled build to compare ({problem}); `make install` builds one")
    compiled, pure = run_scenario(), run_scenario(INFERBUS_PURE_PYTHON="1")
    assert compiled.pop("compiled") is True and pure.pop("compiled") is False
    assert compiled == pure


def fake_build(directory: Path) -> None:
    """A build directory whose manifest matches the current sources (artifacts are empty files)."""
    for name in accel._artifacts():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(b"")
    (directory / accel.MANIFEST).write_text(json.dumps(accel.expected_manifest()))


def test_a_build_is_used_only_when_every_source_and_the_interpreter_match(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFERBUS_PURE_PYTHON", raising=False)
    assert "no build" in (accel.check(tmp_path) or "")
    fake_build(tmp_path)
    assert accel.check(tmp_path) is None
    monkeypatch.setenv("INFERBUS_PURE_PYTHON", "1")
    assert accel.check(tmp_path) == "INFERBUS_PURE_PYTHON is set"
    monkeypatch.delenv("INFERBUS_PURE_PYTHON")

    manifest = json.loads((tmp_path / accel.MANIFEST).read_text())
    manifest["sources"]["tools.capacity.fleetsim.fast"] = "0" * 64  # fast.py edited since the build
    (tmp_path / accel.MANIFEST).write_text(json.dumps(manifest))
    assert accel.check(tmp_path) == "stale: tools.capacity.fleetsim.fast changed since the build"

    fake_build(tmp_path)
    manifest = json.loads((tmp_path / accel.MANIFEST).read_text())
    (tmp_path / accel.MANIFEST).write_text(json.dumps(dict(manifest, ext_suffix=".cpython-39-x86_64-linux-gnu.so")))
    assert "another interpreter" in (accel.check(tmp_path) or "")

    fake_build(tmp_path)
    next(tmp_path.rglob("fast*.so")).unlink()
    assert "incomplete build" in (accel.check(tmp_path) or "")


def test_activate_puts_only_a_current_build_ahead_of_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("INFERBUS_PURE_PYTHON", raising=False)
    monkeypatch.setenv("INFERBUS_ACCEL_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    package_path = ["/src/tools/capacity/fleetsim"]
    assert not accel.activate(package_path) and package_path == ["/src/tools/capacity/fleetsim"]
    fake_build(tmp_path)
    assert accel.activate(package_path)
    assert package_path == [str(tmp_path / "tools" / "capacity" / "fleetsim"), "/src/tools/capacity/fleetsim"]
    assert sys.path[-1] == str(tmp_path)  # the group's shared library, behind everything else


def test_status_says_why_the_simulator_runs_as_python(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("INFERBUS_ACCEL_DIR", str(tmp_path))
    monkeypatch.delenv("INFERBUS_PURE_PYTHON", raising=False)
    assert accel.main(["status"]) == 0
    assert capsys.readouterr().out.startswith(f"pure Python: no build in {tmp_path}")
