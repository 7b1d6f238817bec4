"""One settings object per service, read from environment variables.

Each service declares a frozen dataclass whose fields carry their env var name and help text in
`field(metadata=...)`; `load()` fills it from the environment, `describe()` lists the variables
(used by `--help` and docs/configuration.md).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, TypeVar

T = TypeVar("T")


def env(name: str, default: Any, help: str, formerly: str | None = None) -> Any:
    """Declare a settings field bound to environment variable `name` (or, when `name` is not set,
    to `formerly`: the variable's name before a rename, so existing deployments keep working)."""
    metadata = {"env": name, "help": help} | ({"formerly": formerly} if formerly else {})
    return dataclasses.field(default=default, metadata=metadata)


def _parse(raw: str, kind: Any, name: str) -> Any:
    kind = kind if isinstance(kind, type) else {"int": int, "float": float, "bool": bool, "str": str}.get(
        str(kind).split("|")[0].strip(), str
    )
    try:
        if kind is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        return kind(raw)
    except ValueError:
        raise SystemExit(f"invalid value for {name}: {raw!r} (expected {kind.__name__})") from None


def load(cls: type[T], **overrides: Any) -> T:
    """Build `cls` from its defaults, then the environment, then explicit `overrides`."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        name = f.metadata.get("env")
        formerly = f.metadata.get("formerly")
        if name and name not in os.environ and formerly and formerly in os.environ:
            name = formerly
        if name and name in os.environ:
            values[f.name] = _parse(os.environ[name], f.type, name)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)


def describe(cls: type) -> list[tuple[str, Any, str]]:
    """(env var, default, help) for every field of a settings class."""
    return [
        (f.metadata["env"], f.default, f.metadata.get("help", ""))
        for f in dataclasses.fields(cls)
        if "env" in f.metadata
    ]
