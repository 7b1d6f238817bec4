"""The web console, served by the gateway at /console (docs/console.md): tenants' usage, costs,
keys, limits, batches and adapters; operators' SLOs, fleet, tenants, releases and autoscaler."""

from .pages import install as install_console
from .service import Console

__all__ = ["Console", "install_console"]
