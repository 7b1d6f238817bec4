"""Every model's rollout, and every adapter's, kept current from the `models` bucket (gateways and
routers hold one)."""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from inferbus.bus import connection as bus
from proto import messages as m

from . import store


class Rollouts:
    def __init__(self) -> None:
        self.by_model: dict[str, m.Rollout] = {}
        self.revisions: dict[str, int] = {}
        self.by_adapter: dict[str, m.Rollout] = {}  # adapter name → its rollout (between two versions)
        self.adapter_revisions: dict[str, int] = {}
        self.kv: KeyValue | None = None
        self._watcher: KeyValue.KeyWatcher | None = None
        self._task: asyncio.Task[None] | None = None
        self._keys: dict[str, tuple[str, str]] = {}  # KV key → ("model" or "adapter", its name)
        self.loaded = asyncio.Event()

    async def start(self, js: JetStreamContext) -> None:
        self.kv = await store.bucket(js)
        self._watcher = await self.kv.watch("rollout.>")
        self._task = asyncio.create_task(bus.follow(self._watcher, self._on_put, self._on_delete, self.loaded.set),
                                         name="follow-rollouts")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._watcher is not None:
            await self._watcher.stop()

    def get(self, model: str) -> m.Rollout | None:
        return self.by_model.get(model)

    def adapter(self, name: str) -> m.Rollout | None:
        return self.by_adapter.get(name)

    def _on_put(self, entry: KeyValue.Entry) -> None:
        rollout = store.decode_rollout(entry.value)
        if rollout is None:
            return
        if rollout.adapter:
            self.by_adapter[rollout.adapter] = rollout
            self.adapter_revisions[rollout.adapter] = entry.revision or 0
            self._keys[entry.key] = ("adapter", rollout.adapter)
        else:
            self.by_model[rollout.model] = rollout
            self.revisions[rollout.model] = entry.revision or 0
            self._keys[entry.key] = ("model", rollout.model)

    def _on_delete(self, key: str) -> None:
        kind, name = self._keys.pop(key, ("", ""))
        if kind == "model":
            self.by_model.pop(name, None)
            self.revisions.pop(name, None)
        elif kind == "adapter":
            self.by_adapter.pop(name, None)
            self.adapter_revisions.pop(name, None)
