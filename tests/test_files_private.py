"""Uploaded and generated batch files are private to the service: 0600 files in 0700 directories,
whatever the process's umask (against the platform's NATS for the file records)."""

from __future__ import annotations

import io
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from inferbus.bus import connection as bus
from inferbus.stores.files import FileStore

from .conftest import Platform

pytestmark = pytest.mark.e2e


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The most permissive umask: modes must come from the store, not from the environment."""
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_uploaded_and_generated_files_are_0600_in_0700_directories(
        platform: Platform, tmp_path: Path, open_umask: None) -> None:
    root = tmp_path / "files"
    root.mkdir(mode=0o755)  # an existing, too open, directory is closed too
    nc = await nats.connect(platform.stack.nats_url)
    try:
        _, files_kv = await bus.batch_buckets(nc.jetstream())
        store = FileStore(root, files_kv)
        tenant = "t-" + secrets.token_hex(4)
        uploaded = await store.create(tenant, "in.jsonl", "batch", io.BytesIO(b'{"a":1}\n'))
        generated = await store.write(tenant, "out.jsonl", "batch_output", [b'{"x":1}'])
        assert mode(root) == 0o700 and mode(root / tenant) == 0o700
        assert mode(store.path(uploaded)) == 0o600 and mode(store.path(generated)) == 0o600
    finally:
        await nc.close()
