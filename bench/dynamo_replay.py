"""Runs one `dynamo.replay` offline replay; executed by `.venv-dynamo/bin/python`, not by inferbus.

Reads a JSON job on stdin ({"trace", "engine", "num_workers", "router_mode", "trace_block_size",
"router_config": KvRouterConfig's keyword arguments or null}), writes one JSON line on stdout: Dynamo's summary, every
request's TTFT, TPOT and cached tokens as Dynamo reports them, and the CPU and wall seconds of the replay call alone.
Standard library and Dynamo only: this environment has no inferbus.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    # Dynamo logs to stdout; keep stdout for the result.
    result_fd = os.dup(1)
    os.dup2(2, 1)
    from dynamo._core import KvRouterConfig
    from dynamo.replay.api import run_trace_replay

    router_config = KvRouterConfig(**job["router_config"]) if job.get("router_config") else None

    cpu0, wall0 = time.process_time(), time.perf_counter()
    report = run_trace_replay(
        job["trace"],
        extra_engine_args=job["engine"],
        num_workers=job["num_workers"],
        router_mode=job["router_mode"],
        router_config=router_config,
        trace_block_size=job["trace_block_size"],
        capture_per_request=True,
    )
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    out = {"summary": report.summary, "per_request": report.per_request, "cpu_s": cpu, "wall_s": wall}
    with os.fdopen(result_fd, "w") as stream:
        stream.write(json.dumps(out, default=str) + "\n")


if __name__ == "__main__":
    main()
