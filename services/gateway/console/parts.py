"""What the console reads of its gateway: the stores, the bus and the request path's parts it shows
or acts on. The gateway (`services.gateway.app.Gateway`) is one; each is None until it has started."""

from __future__ import annotations

from typing import Protocol

import redis.asyncio as aioredis
from nats.aio.client import Client
from nats.js import JetStreamContext

from inferbus.stores.batches import BatchStore
from inferbus.stores.files import FileStore
from inferbus.stores.models import ModelCatalog
from inferbus.stores.tenants import TenantStore

from ..fleet import FleetMonitor
from ..generation import Generation
from ..settings import GatewaySettings
from .service import Console


class GatewayParts(Protocol):
    settings: GatewaySettings
    redis: aioredis.Redis | None
    nc: Client | None
    js: JetStreamContext | None
    generation: Generation | None  # its API keys (sessions, revocation) and releases (routing page)
    tenants: TenantStore | None
    fleet: FleetMonitor | None  # the overload policy's view (fleet page)
    catalog: ModelCatalog | None
    files: FileStore | None
    batches: BatchStore | None
    console: Console | None
