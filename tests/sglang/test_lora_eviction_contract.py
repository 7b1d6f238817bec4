"""Past `--max-loaded-loras` the engine evicts by itself, least recently used first, and says so in
the load's answer; a request for an evicted adapter loads it again (evicting the next one). The
simulated engine (services/sim_engine/lora_pool.py) and the worker's view (services/worker/
adapters.py) rely on exactly this, against real SGLang 0.5.23 or the simulator (conftest.py)."""

from __future__ import annotations

import uuid

import httpx
import pytest

from services.worker.engine import EngineClient

from .conftest import MAX_LOADED_LORAS, Engine
from .test_engine_contract import client, request, text_of  # noqa: F401  (the `client` fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def loaded(engine: Engine) -> set[str]:
    models = httpx.get(engine.url + "/v1/models", timeout=30).json()["data"]
    return {model["id"] for model in models if model.get("parent")}


async def test_a_load_past_the_cap_evicts_the_least_recently_used_and_a_request_brings_it_back(
        engine: Engine, client: EngineClient) -> None:  # noqa: F811
    tag = uuid.uuid4().hex[:4]
    names = [f"evict-{tag}-{i}" for i in range(MAX_LOADED_LORAS + 1)]
    before = loaded(engine)
    assert not before, f"another test left adapters loaded: {before}"
    try:
        for name in names[:MAX_LOADED_LORAS]:
            result = await client.load_lora(name, engine.lora_path)
            assert result["success"] is True, result
        # A request makes the first one the most recently used: the second is now the oldest.
        assert await text_of(client, request(max_new_tokens=2, adapter=names[0]))
        result = await client.load_lora(names[-1], engine.lora_path)
        assert result["success"] is True, result
        assert set(result["loaded_adapters"]) == set(names) - {names[1]}
        assert loaded(engine) == set(names) - {names[1]}
        # The evicted adapter still serves: the engine loads it again, evicting the next oldest.
        assert await text_of(client, request(max_new_tokens=2, adapter=names[1]))
        assert loaded(engine) == set(names) - {names[2]}
    finally:
        for name in loaded(engine):
            await client.unload_lora(name)
