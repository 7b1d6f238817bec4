"""The autoscaler end-to-end tests' load: a ramp that needs three workers of a pool."""

from __future__ import annotations

import asyncio
import time

from proto import messages as m

from .conftest import MODEL, Platform


async def ramp(platform: Platform, decisions: list[m.ScaleDecision], pool: str | None = None, recent: int = 4,
               give_up_s: float = 60.0) -> tuple[float, int]:
    """Ramp 1 → 6 req/s over 10 s, hold until the `recent` last scale decisions (of `pool`; None:
    any) say three workers serve, or `give_up_s`, then stop. Returns (when the load stopped, how
    many requests succeeded)."""
    client = platform.async_client(timeout=60)
    ok = 0
    tasks: set[asyncio.Task[None]] = set()

    async def one() -> None:
        nonlocal ok
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "tell me a story"}], max_tokens=64)
        if reply.usage and reply.usage.completion_tokens:
            ok += 1

    start = time.monotonic()
    sent = 0.0
    while True:
        elapsed = time.monotonic() - start
        rate = 1.0 + 5.0 * min(1.0, elapsed / 10.0)
        sent_target = elapsed * rate if elapsed < 10 else 35.0 + (elapsed - 10) * 6.0
        while sent < sent_target:
            sent += 1
            task = asyncio.create_task(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        serving = max((d.serving for d in decisions[-recent:] if pool is None or d.pool == pool), default=0)
        if (elapsed > 15 and serving >= 3) or elapsed > give_up_s:
            break
        await asyncio.sleep(0.05)
    stopped = time.monotonic()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    return stopped, ok
