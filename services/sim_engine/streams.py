"""One request's stream of updates inside the simulated engine's HTTP server, as its endpoints
(native, OpenAI, disaggregated) read it."""

from __future__ import annotations

import asyncio

from .request import RequestUpdate


class Stream:
    __slots__ = ("queue", "arrival", "last_token_at", "tokens_seen", "interval", "internal")

    def __init__(self, arrival: float, interval: int, internal: bool) -> None:
        self.queue: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        self.arrival = arrival
        self.last_token_at = arrival
        self.tokens_seen = 0
        self.interval = interval
        self.internal = internal
