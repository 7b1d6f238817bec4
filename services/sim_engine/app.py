"""The simulated engine's HTTP application: the server for its disaggregation mode, with SGLang's
OpenAI-compatible routes beside its native API."""

from __future__ import annotations

from starlette.applications import Starlette

from inferbus.timing import StepTimeModel

from .config import EngineConfig
from .disagg_server import DisaggEngineServer
from .faults import Mode
from .openai_api import OpenAIRoutes
from .server import SimEngineServer


def build_server(config: EngineConfig, step_model: StepTimeModel | None = None) -> SimEngineServer:
    """The server of `config`'s disaggregation mode, with the OpenAI routes beside the native ones."""
    if config.disaggregation_mode != "null":
        server: SimEngineServer = DisaggEngineServer(config, step_model)
    else:
        server = SimEngineServer(config, step_model)
    server.app.router.routes.extend(OpenAIRoutes(server).routes)
    return server


def create_app(config: EngineConfig, step_model: StepTimeModel | None = None, *,
               faults: Mode | None = None, time_scale_control: bool = False) -> Starlette:
    """The native SGLang API and, beside it, SGLang's OpenAI-compatible endpoints; with `faults`,
    the fault-injection endpoint, starting in that mode; with `time_scale_control`, `/time_scale`."""
    server = build_server(config, step_model)
    if faults is not None:
        server.enable_faults(faults)
    if time_scale_control:
        server.enable_time_scale_control()
    return server.app
