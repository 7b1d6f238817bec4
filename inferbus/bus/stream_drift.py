"""Whether a stream's configuration on the server is the one the platform needs: pure.

Stream and bucket configuration belongs to ops: no service identity may update a stream
(docs/security.md). A service that finds a stream configured otherwise reports the difference (a
log line, a metric, a `/ready` problem) and runs on, instead of trying an update it may not
publish and exiting on the refusal. Only what changes which messages a stream keeps, and for how
long, counts: a new description or metadata is no drift.
"""

from __future__ import annotations

from typing import Any

from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

# Compared fields, with the server's value for a field the wanted config leaves unset.
_SERVER_DEFAULTS: dict[str, Any] = {
    "subjects": [], "retention": RetentionPolicy.LIMITS, "storage": StorageType.FILE, "discard": DiscardPolicy.OLD,
    "max_age": 0.0, "duplicate_window": 120.0, "num_replicas": 1, "max_msgs": -1, "max_bytes": -1,
    "max_msgs_per_subject": -1, "max_msg_size": -1, "max_consumers": -1, "sealed": False, "republish": None,
    "mirror": None, "sources": [], "subject_transform": None,
}


def _normal(name: str, value: Any) -> Any:
    if value is None:
        value = _SERVER_DEFAULTS[name]
    if name == "subjects":
        return sorted(value or [])
    if name == "sources":
        return sorted(repr(s) for s in value or [])
    if isinstance(value, float):
        return round(value, 3)
    return value


def config_drift(wanted: StreamConfig, actual: StreamConfig) -> list[str]:
    """What differs between the config the platform needs and the server's, one line per field
    (`USAGE: max_msgs is 5, wanted -1`); empty when they agree on every compared field."""
    found = []
    for name in _SERVER_DEFAULTS:
        want, have = _normal(name, getattr(wanted, name)), _normal(name, getattr(actual, name))
        if want != have:
            found.append(f"{wanted.name}: {name} is {_show(have)}, wanted {_show(want)}")
    return found


def _show(value: Any) -> str:
    return str(value.value) if hasattr(value, "value") else repr(value) if isinstance(value, str) else str(value)
