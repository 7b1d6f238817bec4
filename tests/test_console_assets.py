"""The console's vendored browser libraries are the npm packages package-lock.json pins, unchanged.

They are committed (services/gateway/console/static/vendor, written by `npm run vendor`), so that
the gateway serves them with no build step and Python needs no Node.js. Offline, the manifest
must name the locked versions and every file must have the digest it records; with npm, a fresh
`npm ci` of the lock file must hold byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CONSOLE = Path(__file__).resolve().parents[1] / "services" / "gateway" / "console"
VENDOR = CONSOLE / "static" / "vendor"


def manifest() -> dict[str, dict[str, str]]:
    return json.loads((VENDOR / "MANIFEST.json").read_text())


def test_vendored_files_are_the_locked_versions_with_their_recorded_digests() -> None:
    lock = json.loads((CONSOLE / "package-lock.json").read_text())
    wanted = json.loads((CONSOLE / "package.json").read_text())["dependencies"]
    found = manifest()
    assert set(found) == {p.name for p in VENDOR.iterdir()} - {"MANIFEST.json"}, (
        "a vendored file is not in the manifest"
    )
    for name, entry in found.items():
        locked = lock["packages"][f"node_modules/{entry['package']}"]["version"]
        assert entry["version"] == locked == wanted[entry["package"]], name
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == entry["sha256"], f"{name} was changed"


def test_pages_load_only_files_the_console_serves() -> None:
    """Every script and stylesheet a template names is in static/ (nothing from another origin,
    which the Content-Security-Policy would refuse anyway)."""
    named = set()
    for template in (CONSOLE / "templates").glob("*.html"):
        named |= set(re.findall(r'(?:src|href)="(/console/static/[^"]+)"', template.read_text()))
        assert not re.search(r'(?:src|href)="(?:https?:)?//', template.read_text()), template.name
    assert named, "no template loads a static file"
    for path in named:
        assert (CONSOLE / path.removeprefix("/console/")).is_file(), path


def test_a_fresh_npm_ci_holds_the_same_files(tmp_path: Path) -> None:
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm not installed: the vendored files are checked against their recorded digests only")
    for name in ("package.json", "package-lock.json"):
        shutil.copy(CONSOLE / name, tmp_path / name)
    done = subprocess.run([npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for name, entry in manifest().items():
        installed = tmp_path / "node_modules" / entry["package"] / entry["source"]
        assert installed.read_bytes() == (VENDOR / name).read_bytes(), (
            f"{name} differs from {entry['package']}'s {entry['source']}"
        )
