"""A variable several services read is declared once (inferbus/runtime/settings.py) and means the same
default everywhere: a default that differed would split the platform the day one is changed (a
worker judged dead by the router and alive by the gateway)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from inferbus.bus.connection import BusSettings
from services.auth_callout.settings import AuthCalloutSettings
from services.autoscaler.settings import AutoscalerSettings
from services.batch.settings import BatchSettings
from services.billing.settings import BillingSettings
from services.gateway.settings import GatewaySettings
from services.router.settings import RouterSettings
from services.worker.settings import WorkerSettings

SETTINGS = (GatewaySettings, RouterSettings, WorkerSettings, BillingSettings, AutoscalerSettings, BatchSettings,
            AuthCalloutSettings, BusSettings)
OWN_DEFAULT = {"INFERBUS_METRICS_PORT"}  # each service its own port, so several can share a host


def declarations() -> dict[str, list[tuple[str, dataclasses.Field]]]:
    found: dict[str, list[tuple[str, dataclasses.Field]]] = defaultdict(list)
    for cls in SETTINGS:
        for field in dataclasses.fields(cls):
            if "env" in field.metadata:
                found[field.metadata["env"]].append((cls.__name__, field))
    return found


def test_a_variable_several_services_read_comes_from_one_declaration() -> None:
    several = {name: fields for name, fields in declarations().items() if len(fields) > 1}
    assert {"NATS_URL", "INFERBUS_HEARTBEAT_TTL_S", "INFERBUS_MODEL", "INFERBUS_LOG_LEVEL"} <= set(several)
    for name, fields in several.items():
        written_out = [owner for owner, field in fields if not field.metadata.get("shared")]
        assert not written_out, (
            f"{name} is declared by hand in {written_out}: use inferbus.runtime.settings' declaration"
        )


def test_a_shared_variable_has_one_default() -> None:
    for name, fields in declarations().items():
        if name in OWN_DEFAULT:
            continue
        defaults = {owner: field.default for owner, field in fields}
        assert len(set(defaults.values())) == 1, (name, defaults)
