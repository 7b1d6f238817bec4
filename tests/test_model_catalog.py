"""The models a tenant can call (inferbus/stores/models.py) against a real nats-server: an adapter
registered a moment ago is served even before the catalog's watch has shown it."""

from __future__ import annotations

import pytest
from nats.aio.client import Client

from inferbus.openai.errors import OpenAIError
from inferbus.stores import adapters as registry
from inferbus.stores.models import ModelCatalog

pytestmark = pytest.mark.slow

BASE = "base-model"
DIGEST = "sha256:" + "ab" * 32



async def test_an_adapter_the_watch_has_not_shown_yet_is_read_from_the_bucket(nc: Client) -> None:
    js = nc.jetstream()
    catalog = ModelCatalog(BASE, created=0)
    await catalog.start(js)
    try:
        # A watch that lags: the registration below reaches the catalog only through `lookup`.
        await catalog.stop()
        await registry.put(await registry.bucket(js), registry.new_spec("fresh-bot", BASE, DIGEST, "/adapters/fresh"))
        with pytest.raises(OpenAIError):
            catalog.resolve("fresh-bot")
        base, adapter = await catalog.lookup("fresh-bot")
        assert base == BASE and adapter is not None and adapter.startswith("fresh-bot")
        assert catalog.resolve("fresh-bot") == (base, adapter)
    finally:
        await catalog.stop()


async def test_an_unknown_or_malformed_name_is_still_a_404(nc: Client) -> None:
    catalog = ModelCatalog(BASE, created=0)
    await catalog.start(nc.jetstream())
    try:
        for name in ("nobody-registered-this", "not a valid name!", ""):
            with pytest.raises(OpenAIError) as refused:
                await catalog.lookup(name)
            assert refused.value.status == 404 and refused.value.code == "model_not_found"
        assert await catalog.lookup(BASE) == (BASE, None)
    finally:
        await catalog.stop()
