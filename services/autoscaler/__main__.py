"""`python -m services.autoscaler`: the autoscaler alone (same as `inferbus autoscaler`)."""

from __future__ import annotations

import uvloop

from inferbus.runtime import settings as settings_mod

from .service import serve
from .settings import AutoscalerSettings

if __name__ == "__main__":
    uvloop.run(serve(settings_mod.load(AutoscalerSettings)))
