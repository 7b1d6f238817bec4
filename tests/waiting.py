"""Waiting on a condition instead of sleeping for a guess: `wait_for`, `await_for`, and
`read_until_api_key` for `inferbus up`'s output.

A test that sleeps "long enough" for something to happen is slow when the machine is idle and
flaky when it is busy. These poll the condition instead and fail with what was awaited.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, *, interval: float = 0.05, what: str = "",
             ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Call `predicate` until it returns something truthy, and return that; `TimeoutError` after
    `timeout` seconds. Exceptions of the types in `ignore` count as "not yet" (until the last try);
    any other ends the wait at once."""
    deadline = time.monotonic() + timeout
    while True:
        last_try = time.monotonic() >= deadline
        try:
            value = predicate()
        except ignore:
            if last_try:
                raise
            value = None  # type: ignore[assignment]
        if value:
            return value
        if last_try:
            raise TimeoutError(f"not within {timeout:g} s: {what or _name(predicate)}")
        time.sleep(interval)


async def await_for(predicate: Callable[[], T | Awaitable[T]], timeout: float = 10.0, *, interval: float = 0.05,
                    what: str = "", ignore: tuple[type[BaseException], ...] = ()) -> T:
    """`wait_for` for a running event loop: the predicate may be a plain or an async function."""
    deadline = time.monotonic() + timeout
    while True:
        last_try = time.monotonic() >= deadline
        try:
            value: Any = predicate()
            if inspect.isawaitable(value):
                value = await value
        except ignore:
            if last_try:
                raise
            value = None
        if value:
            return value  # type: ignore[no-any-return]
        if last_try:
            raise TimeoutError(f"not within {timeout:g} s: {what or _name(predicate)}")
        await asyncio.sleep(interval)


def _name(predicate: Callable[..., Any]) -> str:
    return getattr(predicate, "__qualname__", repr(predicate))


def read_until_api_key(up: subprocess.Popen[str], lines: list[str], deadline: float) -> str | None:
    """Read `inferbus up`'s output into `lines` until it prints the demo API key (returned), it
    exits, or `deadline` (monotonic) passes (None)."""
    assert up.stdout is not None
    while time.monotonic() < deadline:
        line = up.stdout.readline()
        if not line:
            return None
        lines.append(line)
        match = re.search(r"API key:\s+(ib-\S+)", line)
        if match:
            return match.group(1)
    return None

