"""No request stalls another: while the gateway refuses a 3.6 MB body with 10,000 tools and
validates the largest body its limits admit, a stream of small requests keeps being answered; a
schema no decoder can compile is a 400 at the gateway, and a truncated upload is refused."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from .conftest import MODEL, Platform

pytestmark = pytest.mark.e2e

USER = [{"role": "user", "content": "hello"}]


def tool(i: int, properties: int, description: int) -> dict:
    return {"type": "function", "function": {
        "name": f"tool_{i}", "description": f"does thing {i}",
        "parameters": {"type": "object", "required": ["p0"], "properties": {
            f"p{j}": {"type": "string", "description": "d" * description} for j in range(properties)}}}}


def small_request_latencies(platform: Platform, until: threading.Event) -> list[float]:
    """GET /v1/models one after another until `until` is set; the time each took."""
    took: list[float] = []
    with httpx.Client(base_url=platform.base_url, timeout=60,
                      headers={"authorization": f"Bearer {platform.api_key}"}) as http:
        while not until.is_set() or not took:
            start = time.monotonic()
            assert http.get("/models").status_code == 200
            took.append(time.monotonic() - start)
    return took


def test_huge_bodies_do_not_hold_up_small_requests(platform: Platform) -> None:
    baseline = small_request_latencies(platform, _set_after(20))
    huge = json.dumps({"model": MODEL, "messages": USER, "max_tokens": 1,
                       "tools": [tool(i, 2, 60) for i in range(10_000)]}).encode()
    # The largest the limits admit: 128 tools whose schemas take the most checking, 2048 messages;
    # refused at the end, after validation, rendering and tokenization, for its max_tokens.
    admitted = json.dumps({"model": MODEL, "max_tokens": 2**31 - 1, "messages": USER * 2048,
                           "tools": [tool(i, 40, 20) for i in range(128)]}).encode()
    assert 3_000_000 < len(huge) < 4 * 1024 * 1024 and len(admitted) < 4 * 1024 * 1024

    done = threading.Event()
    latencies: list[float] = []
    watcher = threading.Thread(target=lambda: latencies.extend(small_request_latencies(platform, done)))
    watcher.start()
    answers = []
    try:
        with httpx.Client(base_url=platform.base_url, timeout=120,
                          headers={"authorization": f"Bearer {platform.api_key}",
                                   "content-type": "application/json"}) as http:
            for body in (huge, admitted):
                start = time.monotonic()
                answers.append((http.post("/chat/completions", content=body), time.monotonic() - start))
    finally:
        done.set()
        watcher.join()

    (refused, refused_s), (served, served_s) = answers
    print(f"refused in {refused_s:.2f} s, admitted body answered in {served_s:.2f} s; small requests: "
          f"{len(latencies)}, max {max(latencies):.3f} s (baseline max {max(baseline):.3f} s)")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools", refused.text
    assert served.status_code == 400 and served.json()["error"]["code"] == "context_length_exceeded", served.text
    # Small requests take about as long as before, give or take the machine's load (they took up
    # to 10 s when validation ran on the event loop; here it holds the GIL at times).
    bound = max(1.0, 10 * max(baseline))
    assert max(latencies) < bound, (sorted(latencies)[-5:], bound, refused_s, served_s)


def _set_after(count: int) -> threading.Event:
    """An event that `small_request_latencies` sees set once it has made `count` requests."""

    class After(threading.Event):
        def __init__(self) -> None:
            super().__init__()
            self.asked = 0

        def is_set(self) -> bool:
            self.asked += 1
            return self.asked > count

    return After()


def test_a_schema_with_a_ref_cycle_is_a_400_at_the_gateway(platform: Platform) -> None:
    cycle = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
             "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}
    client = platform.client()
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "cyclic", "schema": cycle}})
    assert raised.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
    assert "reference cycle" in raised.value.body["message"]  # type: ignore[index]
    # A recursive schema a decoder can compile passes the gateway (the engine writes a value).
    recursive = {"$defs": {"node": {"type": "object", "properties": {"value": {"type": "integer"},
                                                                     "next": {"$ref": "#/$defs/node"}},
                                    "required": ["value"]}}, "$ref": "#/$defs/node"}
    reply = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=200, response_format={
        "type": "json_schema", "json_schema": {"name": "list", "schema": recursive}})
    assert "value" in json.loads(reply.choices[0].message.content or "")
