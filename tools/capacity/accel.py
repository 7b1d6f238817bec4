"""Compiled builds of the fast simulator's two hot modules, used only while they match the source.

`inferbus simulate` spends its CPU in `analytic` (the replica model) and `fast` (the event loop).
mypyc compiles those modules, unchanged, to C extensions that run the same code two to three
times as fast (bench/results/simulate.md). The Python source stays the only source: the build
goes out of tree, to `.accel/` in the checkout (`INFERBUS_ACCEL_DIR` to move it), with a
manifest of the SHA-256 of every compiled source and the interpreter's extension suffix.
`activate` puts the build ahead of the source only when all of them match, so an edited module is
never shadowed by a stale binary: it runs as Python until the next build. `INFERBUS_PURE_PYTHON=1`
turns the build off.

    python -m tools.capacity.accel build     # `make install` runs it; a failure only warns
    python -m tools.capacity.accel status
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

MODULES = ("tools.capacity.fleetsim.analytic", "tools.capacity.fleetsim.fast")
GROUP = "inferbus_fleetsim_accel"  # the mypyc group's shared library, a top-level module of the build
ROOT = Path(__file__).resolve().parents[2]
MANIFEST = "manifest.json"


def build_dir() -> Path:
    return Path(os.environ.get("INFERBUS_ACCEL_DIR") or ROOT / ".accel")


def _source(module: str) -> Path:
    return ROOT.joinpath(*module.split(".")).with_suffix(".py")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _suffix() -> str:
    return str(sysconfig.get_config_var("EXT_SUFFIX"))


def expected_manifest() -> dict[str, object]:
    return {"ext_suffix": _suffix(), "sources": {module: _digest(_source(module)) for module in MODULES}}


def check(directory: Path | None = None) -> str | None:
    """None when the build in `directory` can be used; otherwise why not."""
    if os.environ.get("INFERBUS_PURE_PYTHON"):
        return "INFERBUS_PURE_PYTHON is set"
    directory = directory or build_dir()
    try:
        found = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no build in {directory} (python -m tools.capacity.accel build)"
    expected = expected_manifest()
    if found.get("ext_suffix") != expected["ext_suffix"]:
        return f"built for another interpreter ({found.get('ext_suffix')})"
    sources: dict[str, str] = expected["sources"]  # type: ignore[assignment]
    stale = [module for module, digest in sources.items() if found.get("sources", {}).get(module) != digest]
    if stale:
        return f"stale: {', '.join(stale)} changed since the build"
    missing = [name for name in _artifacts() if not (directory / name).exists()]
    if missing:
        return f"incomplete build: {', '.join(missing)} missing"
    return None


def _artifacts() -> list[str]:
    suffix = _suffix()
    return [GROUP + "__mypyc" + suffix] + [str(Path(*module.split("."))) + suffix for module in MODULES]


def activate(package_path: list[str]) -> bool:
    """Put a current build ahead of the package's source (`package_path`: `tools.capacity.fleetsim.__path__`).
    Must run before the compiled modules are first imported."""
    directory = build_dir()
    if check(directory) is not None:
        return False
    if str(directory) not in sys.path:
        sys.path.append(str(directory))  # the shared library; appended, so it shadows nothing
    package_path.insert(0, str(directory / "tools" / "capacity" / "fleetsim"))
    return True


def active() -> bool:
    """Whether the running simulator is the compiled build."""
    from tools.capacity.fleetsim import fast

    return not str(getattr(fast, "__file__", "")).endswith(".py")


_SETUP = """
import sys
from setuptools import setup
from mypyc.build import mypycify
modules, group, target, out, temp = sys.argv[1].split(","), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
# Only the compiled modules' own type errors stop the build; what they import is read for types.
options = ["--follow-imports=silent", "--ignore-missing-imports"]
setup(name=group, ext_modules=mypycify(options + modules, group_name=group, target_dir=target),
      script_args=["-q", "build_ext", "--build-lib", out, "--build-temp", temp])
"""


def build(directory: Path | None = None) -> None:
    """Compile MODULES with mypyc into `directory` (replacing what is there); raises on failure."""
    directory = directory or build_dir()
    manifest = expected_manifest()  # hashed before compiling: an edit during the build makes it stale
    with tempfile.TemporaryDirectory(prefix="inferbus-accel-") as tmp:
        work = Path(tmp)
        env = dict(os.environ, MYPY_CACHE_DIR=str(work / "mypy-cache"))
        paths = ",".join(str(_source(module).relative_to(ROOT)) for module in MODULES)
        completed = subprocess.run(
            [sys.executable, "-c", _SETUP, paths, GROUP, str(work / "c"), str(work / "lib"), str(work / "temp")],
            cwd=ROOT, env=env, capture_output=True, text=True,
        )
        if completed.returncode != 0:
            raise RuntimeError((completed.stdout + completed.stderr)[-4000:])
        staged = directory.with_name(directory.name + ".new")
        shutil.rmtree(staged, ignore_errors=True)
        for name in _artifacts():
            target = staged / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(work / "lib" / name, target)
        (staged / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(directory, ignore_errors=True)
    staged.rename(directory)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tools.capacity.accel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build", "status"])
    parser.add_argument("--if-stale", action="store_true", help="build: do nothing when the build is current")
    parser.add_argument("--warn-only", action="store_true",
                        help="build: report a failure and exit 0 (the simulator then runs as pure Python)")
    args = parser.parse_args(argv)
    if args.command == "status":
        problem = check()
        print("compiled build in use" if problem is None else f"pure Python: {problem}")
        return 0
    if args.if_stale and check() is None:
        return 0
    try:
        import mypyc  # noqa: F401
    except ImportError:
        message = "mypyc is not installed (pip install mypy)"
        print(f"accel: {message}; the fleet simulator runs as pure Python", file=sys.stderr)
        return 0 if args.warn_only else 1
    print(f"accel: compiling {', '.join(MODULES)} with mypyc into {build_dir()} …", file=sys.stderr, flush=True)
    try:
        build()
    except (RuntimeError, OSError) as error:
        print(f"accel: the build failed; the fleet simulator runs as pure Python (two to three times slower):\n{error}",
              file=sys.stderr)
        return 0 if args.warn_only else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
