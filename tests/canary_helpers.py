"""Shared by the release and adapter canary end-to-end tests: closed-loop conversations, the
canary's published decisions, and the CLI pointed at the test platform's bus."""

from __future__ import annotations

import asyncio
import threading

import msgspec
import nats
import openai
from click.testing import CliRunner

from proto import messages as m
from proto import subjects
from tools.commands.main import main

from .conftest import MODEL, Platform


def cli(platform: Platform, *args: str) -> str:
    result = CliRunner().invoke(main, [*args, "--nats-url", platform.stack.nats_url])
    assert result.exit_code == 0, result.output
    return result.stdout


class Load:
    """Closed-loop chat clients on one model, each conversation with its own first prefix block."""

    def __init__(self, platform: Platform, api_key: str | None = None, model: str = MODEL, clients: int = 8,
                 tag: str = "") -> None:
        self.platform, self.model, self.clients = platform, model, clients
        self.api_key = api_key or platform.api_key
        self.prefix = f"{tag} conversation" if tag else "Conversation"
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.ids: list[str] = []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)

    async def _run(self) -> None:
        client = openai.AsyncOpenAI(base_url=self.platform.base_url, api_key=self.api_key, max_retries=0, timeout=60)

        async def one(worker: int) -> None:
            i = 0
            while not self.stop.is_set():
                i += 1
                words = " ".join(f"w{(worker * 7919 + i * 31 + k) % 997}" for k in range(60))
                try:
                    reply = await client.chat.completions.create(
                        model=self.model, max_tokens=12,
                        messages=[{"role": "user", "content": f"{self.prefix} {worker}-{i}: {words}"}])
                    self.ids.append(reply.id.removeprefix("chatcmpl-"))
                except Exception as error:  # any error fails the test
                    self.errors.append(repr(error))

        await asyncio.gather(*(one(w) for w in range(self.clients)))


class Decisions:
    """Canary decisions published for the model or adapter `name` from when the block is entered:
    they go out on core NATS, which keeps none, so a test subscribes before the step that makes
    one (an eval verdict is acted on at the router's next tick, half a second later)."""

    def __init__(self, platform: Platform, name: str) -> None:
        self.platform, self.name = platform, name
        self.seen: list[m.ReleaseDecision] = []
        self._changed = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="decisions", daemon=True)
        self._nc: nats.NATS | None = None

    def __enter__(self) -> Decisions:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._subscribe(), self._loop).result(30)
        return self

    def __exit__(self, *_: object) -> None:
        if self._nc is not None:
            asyncio.run_coroutine_threadsafe(self._nc.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _subscribe(self) -> None:
        self._nc = await nats.connect(self.platform.stack.nats_url)

        async def on(msg) -> None:  # type: ignore[no-untyped-def]
            with self._changed:
                self.seen.append(msgspec.msgpack.decode(msg.data, type=m.ReleaseDecision))
                self._changed.notify_all()

        await self._nc.subscribe(subjects.release_subject(self.name), cb=on)
        await self._nc.flush()  # subscribed at the server before the test goes on

    def until(self, actions: set[str], timeout: float) -> list[m.ReleaseDecision]:
        """The decisions seen, once one of `actions` is among them (or after `timeout`)."""
        with self._changed:
            self._changed.wait_for(lambda: any(d.action in actions for d in self.seen), timeout)
            return list(self.seen)


def decisions(platform: Platform, name: str, until: set[str], timeout: float) -> list[m.ReleaseDecision]:
    """Canary decisions published for the model or adapter `name` from now, until one of the
    actions in `until` (or timeout)."""
    with Decisions(platform, name) as watch:
        return watch.until(until, timeout)
