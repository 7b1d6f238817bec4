"""A worker runs an interactive request only as its gateway dispatched it (`inferbus/stores/dispatch_records.py`)."""

from __future__ import annotations

import msgspec
import pytest

from inferbus.stores.dispatch_records import record, request_refusal
from proto import messages as m

REQUEST = m.InferenceRequest(request_id="chatcmpl-1", tenant="acme", model="m", prompt="p",
                             sampling=m.SamplingParams(max_new_tokens=8), reply_to="inferbus.tok.gateway-a",
                             deadline=0.0, created=0.0)


@pytest.mark.parametrize(("dispatched", "why"), [
    (record(REQUEST, 1.0), None),  # what the gateway queued
    (record(msgspec.structs.replace(REQUEST, attempt=2, prompt="other"), 1.0), None),  # a later attempt's record
    (None, "not_dispatched"),  # nobody dispatched it (the router made it up)
    (record(msgspec.structs.replace(REQUEST, tenant="globex"), 1.0), "dispatched_for_another_tenant"),
    (record(msgspec.structs.replace(REQUEST, request_id="chatcmpl-2"), 1.0), "dispatched_for_another_tenant"),
    (record(msgspec.structs.replace(REQUEST, reply_to="inferbus.tok.gateway-b"), 1.0), "dispatched_to_another_owner"),
])
def test_request_refusal(dispatched: m.Dispatch | None, why: str | None) -> None:
    assert request_refusal(REQUEST, dispatched) == why
