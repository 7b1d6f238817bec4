"""Files and directories only their owner may read: the local platform's state dir holds data and
credentials (passwords, tokens, private keys), and its processes' files are theirs alone."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner may read (0600), whatever the umask: it holds credentials.
    Replaced whole (a rename), so a reader never sees it half written."""
    private_dir(path.parent)
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(text)
    os.replace(partial, path)


def private_dir(path: Path) -> None:
    """Create `path` (and its parents) and make it 0700: the state dir holds data and credentials."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


# What the platform's processes create (Redis's append-only file, JetStream's store, the usage
# outboxes' SQLite files and their -wal/-shm, logs, files, exports) is theirs alone: they run
# with this umask, so every file is 0600 and every directory 0700.
CHILD_UMASK = 0o077


def make_private_tree(path: Path) -> None:
    """Make every directory under `path` (itself included) 0700 and every file 0600."""
    for directory, _, files in os.walk(path):
        os.chmod(directory, 0o700)
        for name in files:
            file = Path(directory) / name
            if not file.is_symlink():
                os.chmod(file, 0o600)


# Files `inferbus up` writes that hold secrets (passwords, tokens, private keys): removed when
# it stops. They are written again at every start.
SECRET_FILES = ("nats.conf", "nats-*.conf", "redis.conf", "redis-*.conf", "sentinel-*.conf",
                "callout-tokens.json", "tokens/*", "tls/*.key")


def remove_secrets(state_dir: Path) -> list[Path]:
    """Remove the files of SECRET_FILES under `state_dir`; returns those removed."""
    removed = []
    for pattern in SECRET_FILES:
        for path in state_dir.glob(pattern):
            if path.is_file():
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed
