"""`python -m services.batch`: the batch service alone (same as `inferbus batch`)."""

from __future__ import annotations

import uvloop

from inferbus.runtime import settings as settings_mod

from .service import serve
from .settings import BatchSettings

if __name__ == "__main__":
    uvloop.run(serve(settings_mod.load(BatchSettings)))
