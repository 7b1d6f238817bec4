"""SGLang's adapter endpoints on the simulated engine: `/load_lora_adapter` and
`/unload_lora_adapter`, answered when SGLang answers them."""

from __future__ import annotations

import asyncio
from typing import Protocol

import msgspec
from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.routing import Route

from .config import EngineConfig
from .lora_files import adapter_problem
from .request import LoraUpdateResult
from .responses import error_response, json_response
from .scheduler import Engine


class LoraServing(Protocol):
    """What the adapter routes use of the engine's HTTP server (`server.SimEngineServer`): the
    engine, its clock's scale, and its step loop's catch-up and wake-up."""

    config: EngineConfig
    engine: Engine
    time_scale: float

    def catch_up(self) -> None: ...

    def wake(self) -> None: ...


class LoadLoraInput(msgspec.Struct):
    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoraInput(msgspec.Struct):
    lora_name: str


def lora_response(result: LoraUpdateResult) -> Response:
    payload = {
        "success": result.success,
        "error_message": result.error_message,
        "loaded_adapters": result.loaded_adapters,
    }
    return json_response(payload, 200 if result.success else 400)


class LoraRoutes:
    """The adapter endpoints of one engine server (`load`, `unload`)."""

    def __init__(self, server: LoraServing) -> None:
        self.server = server
        # SGLang serialises adapter loads and unloads behind one lock (its tokenizer manager's
        # lora_update_lock): a load queued behind another starts when that one has answered.
        self._update_lock = asyncio.Lock()

    def routes(self) -> list[Route]:
        return [
            Route("/load_lora_adapter", self.load, methods=["POST"]),
            Route("/unload_lora_adapter", self.unload, methods=["POST"]),
        ]

    async def load(self, http_request: HttpRequest) -> Response:
        try:
            body = msgspec.json.decode(await http_request.body(), type=LoadLoraInput)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return error_response(str(exc))
        server = self.server
        engine = server.engine
        problem = adapter_problem(body.lora_name, body.lora_path, server.config.max_lora_rank)
        if problem is not None:
            loaded = {name: adapter.path for name, adapter in engine.adapters.items()}
            return lora_response(LoraUpdateResult(False, problem, loaded))
        async with self._update_lock:
            server.catch_up()
            result = engine.load_lora(body.lora_name, body.lora_path, body.pinned)
            if result.success:
                server.wake()
                # SGLang answers once the weights are loaded, and after an eviction once the evicted
                # adapter's requests have finished (it frees the weights only then).
                adapter = engine.adapters.get(body.lora_name)
                if adapter is not None:
                    await asyncio.sleep(max(0.0, adapter.ready_at - engine.now) * server.time_scale)
                if result.evicted:
                    holders = [r for r in list(engine.waiting) + list(engine.running)
                               if r.lora_name in result.evicted]
                    while any(r.finish_reason is None and engine.get(r.rid) is r for r in holders):
                        await asyncio.sleep(0.01)
        return lora_response(result)

    async def unload(self, http_request: HttpRequest) -> Response:
        try:
            body = msgspec.json.decode(await http_request.body(), type=UnloadLoraInput)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return error_response(str(exc))
        async with self._update_lock:
            return lora_response(self.server.engine.unload_lora(body.lora_name))
