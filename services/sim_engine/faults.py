"""Injected GPU faults for the simulated engine: the failures a real GPU has, on demand.

- `hang`: the step loop stops (a stuck kernel, a lost NCCL peer): requests stay running and
  produce nothing, while the HTTP server still answers `/ready` and `/server_info`; `/health`
  (a one-token generation through the scheduler, as SGLang's) times out.
- `fail`: every generation and health check fails with a 500 (an Xid error, ECC failure).
- `none`: healthy again.

Off unless the engine is started with `--fault-injection` (INFERBUS_SIM_FAULT_INJECTION): then
`POST /fault {"mode": "hang" | "fail" | "none"}` sets the mode and `GET /fault` reads it, and
`--fault MODE` starts in a mode. The endpoint is unauthenticated, like the rest of SGLang's API:
an engine listens where only its worker reaches it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

Mode = Literal["none", "hang", "fail"]
MODES: tuple[str, ...] = ("none", "hang", "fail")

logger = logging.getLogger(__name__)


class _FaultBody(msgspec.Struct):
    mode: Mode


class Faults:
    def __init__(self, mode: Mode = "none") -> None:
        self.mode: Mode = mode
        self._cleared = asyncio.Event()
        if mode == "none":
            self._cleared.set()

    @property
    def hung(self) -> bool:
        return self.mode == "hang"

    @property
    def failing(self) -> bool:
        return self.mode == "fail"

    def set(self, mode: Mode) -> None:
        logger.warning("fault injected: %s", mode)
        self.mode = mode
        if mode == "hang":
            self._cleared.clear()
        else:
            self._cleared.set()

    async def wait_unhung(self) -> None:
        await self._cleared.wait()

    async def endpoint(self, request: Request) -> Response:
        if request.method == "GET":
            return JSONResponse({"mode": self.mode})
        try:
            body = msgspec.json.decode(await request.body(), type=_FaultBody)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return JSONResponse({"error": f"{exc}; expected {{\"mode\": one of {list(MODES)}}}"}, status_code=400)
        self.set(body.mode)
        return JSONResponse({"mode": self.mode})

    def route(self) -> Route:
        return Route("/fault", self.endpoint, methods=["GET", "POST"])

    @staticmethod
    def failure() -> Response:
        return JSONResponse({"error": {"message": "injected GPU failure", "code": 500}}, status_code=500)
