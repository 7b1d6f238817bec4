"""The console's part of a running gateway: sessions, the live view of the fleet, the SLO recorder."""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferbus import logs

from . import slo
from .auth import Sessions
from .live import Live
from .recorder import SloRecorder

if TYPE_CHECKING:
    from ..app import Gateway

log = logs.get(__name__)


class Console:
    def __init__(self, gateway: Gateway) -> None:
        s = gateway.settings
        assert gateway.redis is not None and gateway.generation is not None and gateway.nc is not None
        assert gateway.js is not None
        self.gateway = gateway
        self.budgets = slo.Budgets(ttft_p90_s=s.slo_ttft_p90_s, tpot_p90_s=s.slo_tpot_p90_s,
                                   error_share=s.slo_error_share)
        self.sessions = Sessions(gateway.redis, gateway.generation.keys, s.admin_key, idle_s=s.console_idle_s,
                                 max_age_s=s.console_max_age_s)
        self.live = Live(gateway.nc, gateway.js, s.heartbeat_ttl_s)
        self.recorder = SloRecorder(gateway.redis, interval_s=s.slo_record_interval_s)

    async def start(self) -> None:
        await self.live.start()
        await self.recorder.start()
        log.info("console_ready", path="/console/")

    async def stop(self) -> None:
        await self.recorder.stop()
        await self.live.stop()
