"""The console's part of a running gateway: sessions, the live view of the fleet, the SLO recorder."""

from __future__ import annotations

import redis.asyncio as aioredis
from nats.aio.client import Client
from nats.js import JetStreamContext

from inferbus.runtime import logs
from inferbus.stores.keys import KeyStore

from ..settings import GatewaySettings
from . import slo
from .auth import Sessions
from .live import Live
from .recorder import SloRecorder

log = logs.get(__name__)


class Console:
    def __init__(self, settings: GatewaySettings, redis: aioredis.Redis, keys: KeyStore, nc: Client,
                 js: JetStreamContext) -> None:
        s = settings
        self.budgets = slo.Budgets(ttft_p90_s=s.slo_ttft_p90_s, tpot_p90_s=s.slo_tpot_p90_s,
                                   error_share=s.slo_error_share)
        self.sessions = Sessions(redis, keys, s.admin_key, idle_s=s.console_idle_s, max_age_s=s.console_max_age_s)
        self.live = Live(nc, js, s.heartbeat_ttl_s)
        self.recorder = SloRecorder(redis, interval_s=s.slo_record_interval_s)

    async def start(self) -> None:
        await self.live.start()
        await self.recorder.start()
        log.info("console_ready", path="/console/")

    async def stop(self) -> None:
        await self.recorder.stop()
        await self.live.stop()
