"""LoRA adapters on this worker's engine: loaded on first use (or when the router asks), verified.

Verification does not trust the load call's 200: some engines accept any path and fail only when
the adapter is first used, or serve the base model. After a load the adapter must be listed by the
engine and a one-token generation with it must succeed; otherwise it is unloaded and every
request for it fails with a clear error instead of running on weights nobody registered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from inferbus import logs
from proto import messages as m

from . import release_check
from .engine import EngineClient, EngineError

log = logs.get(__name__)


class AdapterError(EngineError):
    def __init__(self, message: str) -> None:
        super().__init__(message, code="adapter_unavailable", retryable=False, status=503)


class Adapters:
    def __init__(self, engine: EngineClient, lookup: Callable[[str], Awaitable[m.AdapterSpec | None]]) -> None:
        self.engine = engine
        self.lookup = lookup  # adapter name → registered spec
        self.loaded: dict[str, m.AdapterSpec] = {}  # engine name → spec
        self._loading: dict[str, asyncio.Future[None]] = {}

    def names(self) -> list[str]:
        return sorted(self.loaded)

    async def ensure(self, engine_name: str) -> None:
        """Make `engine_name` (`<name>@<digest prefix>`) usable on the engine, once."""
        if engine_name in self.loaded:
            return
        pending = self._loading.get(engine_name)
        if pending is None:
            pending = self._loading[engine_name] = asyncio.ensure_future(self._load(engine_name))
            pending.add_done_callback(lambda _: self._loading.pop(engine_name, None))
        await asyncio.shield(pending)

    async def _load(self, engine_name: str) -> None:
        name = engine_name.rpartition("@")[0]
        spec = await self.lookup(name)
        if spec is None or spec.engine_name != engine_name:
            raise AdapterError(f"adapter {engine_name} is not registered (or its version changed)")
        mismatch = release_check.adapter_problem(spec)
        if mismatch is not None:
            log.error("adapter_digest_mismatch", adapter=engine_name, path=spec.path, problem=mismatch)
            raise AdapterError(f"adapter {spec.name} refused: {mismatch}")
        result = await self.engine.load_lora(engine_name, spec.path)
        if not result.get("success", False) and engine_name not in (result.get("loaded_adapters") or {}):
            raise AdapterError(f"engine could not load adapter {spec.name}: {result.get('error_message') or 'unknown error'}")
        problem = await self._verify(engine_name, result)
        if problem is not None:
            await self.engine.unload_lora(engine_name)
            log.error("adapter_verification_failed", adapter=engine_name, path=spec.path, problem=problem)
            raise AdapterError(f"adapter {spec.name} failed verification after loading: {problem}")
        self.loaded[engine_name] = spec
        log.info("adapter_loaded", adapter=engine_name, path=spec.path)

    async def _verify(self, engine_name: str, result: dict) -> str | None:
        listed = result.get("loaded_adapters")
        if listed is not None and engine_name not in listed:
            return "the engine does not list it as loaded"
        try:
            await self.engine.probe(engine_name)
        except EngineError as error:
            return f"a one-token generation with it failed: {error}"
        return None

    def forget(self, engine_name: str) -> None:
        """The engine no longer has it (it restarted): load it again on next use."""
        self.loaded.pop(engine_name, None)

    def forget_all(self) -> int:
        count = len(self.loaded)
        self.loaded.clear()
        return count

    async def unload(self, engine_name: str) -> None:
        if self.loaded.pop(engine_name, None) is not None:
            await self.engine.unload_lora(engine_name)
