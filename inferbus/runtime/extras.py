"""Optional dependencies, imported where they are used, with a message that says how to get them.

Plotting (matplotlib), Parquet (pyarrow) and the Kubernetes client are extras of the package, not
dependencies of every service: `pip install 'inferbus[plots]'`, `[parquet]`, `[k8s]` (`[dev]`
has them all).
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """An optional dependency that a feature needs is not installed."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module`, or say which extra of inferbus provides it: `feature` needs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingExtra(
            f"{feature} needs {module}, which is not installed: pip install 'inferbus[{extra}]'"
        ) from error
