"""Every model's rollout, kept current from the `models` bucket (gateways and routers hold one)."""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from inferbus import bus
from proto import messages as m

from . import store


class Rollouts:
    def __init__(self) -> None:
        self.by_model: dict[str, m.Rollout] = {}
        self.revisions: dict[str, int] = {}
        self.kv: KeyValue | None = None
        self._watcher: KeyValue.KeyWatcher | None = None
        self._task: asyncio.Task[None] | None = None
        self._keys: dict[str, str] = {}  # KV key → model
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

    def _on_put(self, entry: KeyValue.Entry) -> None:
        rollout = store.decode_rollout(entry.value)
        if rollout is not None:
            self.by_model[rollout.model] = rollout
            self.revisions[rollout.model] = entry.revision or 0
            self._keys[entry.key] = rollout.model

    def _on_delete(self, key: str) -> None:
        model = self._keys.pop(key, None)
        if model is not None:
            self.by_model.pop(model, None)
            self.revisions.pop(model, None)
