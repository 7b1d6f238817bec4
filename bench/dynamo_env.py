"""NVIDIA Dynamo 1.6.1 in its own virtualenv (`.venv-dynamo`), installed on first use.

`pip install ai-dynamo==1.6.1` cannot work from PyPI alone: its dependency `aisimulate` is a
placeholder package that fetches the real wheel from NVIDIA's own index at install time. The
frontend, KV router, mocker and offline replay do not import it (only the planner, simulation
sweeps and the `--ais-perf-model` timing do), so the two Dynamo wheels go in with `--no-deps` and
their other declared dependencies by name. Nothing of Dynamo's is part of this repository.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-dynamo"
PYTHON = VENV / "bin" / "python"
VERSION = "1.6.1"
WHEELS = [f"ai-dynamo=={VERSION}", f"ai-dynamo-runtime=={VERSION}"]
# ai-dynamo 1.6.1's declared dependencies (`pip show ai-dynamo`) except aisimulate, ai-dynamo-runtime's
# (the frontend and mocker need them; the offline replay does not), plus numpy for the profile tables.
DEPENDENCIES = [
    "aiohttp>=3.14.3,<4.0", "certifi>=2026.10.19", "kubernetes>=32.0.1,<33.0.0", "msgspec>=0.19.0",
    "prometheus-client>=0.23.1,<1.0", "pyzmq>=26.0.0", "redis>=6.2.0,<9.0.0", "tqdm>=4.0.0",
    "transformers>=4.56.0", "typing-extensions>=4.10.0", "zstandard>=0.23.0,<1.0",
    "pydantic>=2.10.6,<=2.13.5", "uvloop>=0.21.0", "numpy",
]
STAMP = VENV / f".installed-{VERSION}"


def ensure() -> Path:
    """The Dynamo interpreter, installing it first if needed (a few minutes, ~720 MB)."""
    wanted = "\n".join(WHEELS + DEPENDENCIES)
    if STAMP.exists() and STAMP.read_text() == wanted:
        return PYTHON
    print(f"installing NVIDIA Dynamo {VERSION} into {VENV} (first use) …", flush=True)
    if not PYTHON.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(PYTHON), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--no-deps", *WHEELS], check=True)
    subprocess.run([*pip, *DEPENDENCIES], check=True)
    STAMP.write_text(wanted)  # a changed dependency list installs again
    return PYTHON
