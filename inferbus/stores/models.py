"""The models a tenant can call: the base model plus the registered LoRA adapters it may use.

Adapters come from the `adapters` KV bucket, watched so a registration is visible at once. The
watch trails a registration by a moment, so a name it has not shown yet is read from the bucket
before it is refused: a client that registers an adapter and calls it at once is served. A request
for an adapter runs on its base model with the adapter's engine name (pinned version).
"""

from __future__ import annotations

import asyncio
from typing import Any

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from inferbus.bus import connection as bus
from inferbus.openai.errors import OpenAIError
from inferbus.stores import adapters as registry
from inferbus.stores.tenants import Tenant, may_use_adapter, may_use_model
from proto import messages as m


class ModelCatalog:
    def __init__(self, base_model: str, created: int) -> None:
        self.base_model = base_model
        self.created = created
        self.adapters: dict[str, m.AdapterSpec] = {}
        self._task: asyncio.Task[None] | None = None
        self._watcher: KeyValue.KeyWatcher | None = None
        self._kv: KeyValue | None = None

    async def start(self, js: JetStreamContext) -> None:
        kv = self._kv = await registry.bucket(js)
        self._watcher = await kv.watchall()
        self._task = asyncio.create_task(self._watch(), name="watch-adapters")

    async def stop(self) -> None:
        task, watcher, self._task, self._watcher = self._task, self._watcher, None, None
        if task is not None:
            task.cancel()
        if watcher is not None:
            await watcher.stop()

    async def _watch(self) -> None:
        assert self._watcher is not None
        await bus.follow(self._watcher, self._on_put, self._on_delete)

    def _on_put(self, entry: KeyValue.Entry) -> None:
        spec = registry.decode(entry.value)
        if spec is not None:
            self.adapters[spec.name] = spec

    def _on_delete(self, key: str) -> None:
        self.adapters = {name: spec for name, spec in self.adapters.items() if registry.key(name) != key}

    def visible(self, tenant: Tenant | None, name: str) -> bool:
        if tenant is None:
            return True
        spec = self.adapters.get(name)
        if spec is not None:
            return may_use_adapter(tenant, name, spec.owner)
        return may_use_model(tenant, name)

    def resolve(self, model: str, tenant: Tenant | None = None) -> tuple[str, str | None]:
        """(base model, adapter engine name or None) for a requested `model`; 404 if not visible."""
        if model == self.base_model and self.visible(tenant, model):
            return model, None
        spec = self.adapters.get(model)
        if spec is not None and spec.base_model == self.base_model and self.visible(tenant, model):
            return spec.base_model, spec.engine_name
        # 404, not 403, for a model the tenant may not use: names must not leak.
        raise OpenAIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                          param="model", code="model_not_found")

    async def lookup(self, model: str, tenant: Tenant | None = None) -> tuple[str, str | None]:
        """`resolve`, reading an adapter the watch has not shown yet from the bucket first."""
        if model != self.base_model and model not in self.adapters and self._kv is not None \
                and registry.NAME.match(model):
            spec = await registry.get(self._kv, model)
            if spec is not None and model not in self.adapters:
                self.adapters[model] = spec
        return self.resolve(model, tenant)

    def card(self, model: str) -> dict[str, Any]:
        spec = self.adapters.get(model)
        if spec is None:
            return {"id": model, "object": "model", "created": self.created, "owned_by": "inferbus"}
        return {
            "id": spec.name, "object": "model", "created": int(spec.created), "owned_by": spec.owner or "inferbus",
            "parent": spec.base_model, "version": spec.version,
        }

    def cards(self, tenant: Tenant | None) -> list[dict[str, Any]]:
        names = [self.base_model] if self.visible(tenant, self.base_model) else []
        names += sorted(name for name, spec in self.adapters.items()
                        if spec.base_model == self.base_model and self.visible(tenant, name))
        return [self.card(name) for name in names]
