"""Release records: digests of a model directory, validation of pins, content-addressed ids.

A release names everything that changes what a model answers: the checkpoint (repository, a
commit id, the digest of every file the engine loads), the chat template, the engine build and its
behaviour-changing flags, and adapters with the digest of their files. Its id is the SHA-256 of
that content, so two records with the same id are the same release.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec

from proto import messages as m

COMMIT = re.compile(r"^[0-9a-f]{40}$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]*@sha256:[0-9a-f]{64}$")
# Engine flags a release pins, as SGLang names them in /server_info; others do not change answers.
BEHAVIOUR_FLAGS = ("quantization", "kv_cache_dtype", "tp_size", "speculative_num_steps", "speculative_algorithm",
                   "chunked_prefill_size", "max_lora_rank", "version", "sim_eval_accuracy")
_CHUNK = 1 << 20


class InvalidRelease(ValueError):
    """A release that cannot be created or served; the message is meant for people."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def directory_files(directory: str | Path) -> list[m.ModelFile]:
    """Every regular file under `directory` (hidden ones excluded), sorted by path, with digests."""
    root = Path(directory)
    if not root.is_dir():
        raise InvalidRelease(f"{root} is not a directory")
    files = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if any(part.startswith(".") for part in relative.parts) or not path.is_file():
            continue
        files.append(m.ModelFile(path=relative.as_posix(), size=path.stat().st_size, sha256=file_sha256(path)))
    if not files:
        raise InvalidRelease(f"{root} has no files")
    return files


def tree_digest(files: Iterable[m.ModelFile]) -> str:
    """`sha256:` over the sorted (path, file digest) list: one digest for a directory's content."""
    listing = "".join(f"{f.path}\0{f.sha256}\n" for f in sorted(files, key=lambda f: f.path))
    return "sha256:" + hashlib.sha256(listing.encode()).hexdigest()


def directory_digest(directory: str | Path) -> str:
    return tree_digest(directory_files(directory))


def chat_template_sha256(directory: str | Path) -> str:
    """Digest of the chat template the gateway renders with: `chat_template.jinja` if present,
    else the `chat_template` of `tokenizer_config.json` (as `inferbus.tokens.prompt` loads it)."""
    root = Path(directory)
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        text = jinja.read_text()
    else:
        try:
            config = json.loads((root / "tokenizer_config.json").read_text())
        except (OSError, ValueError) as error:
            raise InvalidRelease(f"{root} has no chat template (no chat_template.jinja, {error})") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            raise InvalidRelease(f"{root}/tokenizer_config.json has no chat_template")
        text = template
    return hashlib.sha256(text.encode()).hexdigest()


def check_pins(repo: str, revision: str, engine_image: str, adapters: Iterable[m.ReleaseAdapter] = ()) -> None:
    """Refuse floating references: a branch or tag for the checkpoint, a tag for the engine image,
    an adapter without a digest."""
    if not repo or repo.strip() != repo:
        raise InvalidRelease("the checkpoint's repository id must not be empty")
    if not COMMIT.match(revision):
        raise InvalidRelease(
            f"revision {revision!r} is not a pinned commit: give the full 40-hex commit id "
            "(branches and tags such as 'main' or 'latest' move, so every replica could serve other weights)"
        )
    if not IMAGE.match(engine_image):
        raise InvalidRelease(
            f"engine image {engine_image!r} is not pinned by digest: give '<image>@sha256:<64 hex>' (tags move)"
        )
    for adapter in adapters:
        if not DIGEST.match(adapter.digest):
            raise InvalidRelease(f"adapter {adapter.name!r} version {adapter.digest!r} is not 'sha256:<64 hex>'")


def _content(release: m.Release) -> bytes:
    fields = msgspec.structs.asdict(release)
    for name in ("id", "created", "note", "v"):
        fields.pop(name, None)
    return json.dumps(msgspec.to_builtins(fields), sort_keys=True, separators=(",", ":")).encode()


def release_id(release: m.Release) -> str:
    return "sha256:" + hashlib.sha256(_content(release)).hexdigest()


def build_release(
    model: str, model_dir: str | Path, *, repo: str, revision: str, engine_image: str,
    engine_flags: Mapping[str, object] | None = None, adapters: Iterable[m.ReleaseAdapter] = (),
    created: float = 0.0, note: str = "",
) -> m.Release:
    """A validated release of the model directory as it is now."""
    adapters = sorted(adapters, key=lambda a: a.name)
    check_pins(repo, revision, engine_image, adapters)
    flags = {str(k): str(v) for k, v in sorted((engine_flags or {}).items())}
    unknown = sorted(set(flags) - set(BEHAVIOUR_FLAGS))
    if unknown:
        raise InvalidRelease(f"unknown engine flags {unknown}: a release pins {', '.join(BEHAVIOUR_FLAGS)}")
    release = m.Release(
        id="", model=model, repo=repo, revision=revision, files=directory_files(model_dir),
        chat_template_sha256=chat_template_sha256(model_dir), engine_image=engine_image, engine_flags=flags,
        adapters=list(adapters), created=created, note=note,
    )
    return msgspec.structs.replace(release, id=release_id(release))


def verify_files(expected: Iterable[m.ModelFile], directory: str | Path) -> list[str]:
    """What differs between the release's files and the directory's, in words (empty: identical)."""
    try:
        found = {f.path: f for f in directory_files(directory)}
    except InvalidRelease as error:
        return [str(error)]
    problems = []
    for want in expected:
        have = found.pop(want.path, None)
        if have is None:
            problems.append(f"{want.path} is missing")
        elif have.sha256 != want.sha256:
            problems.append(f"{want.path} has sha256 {have.sha256[:12]}…, the release says {want.sha256[:12]}…")
    problems += [f"{path} is not part of the release" for path in sorted(found)]
    return problems


def verify_engine_flags(expected: Mapping[str, str], server_info: Mapping[str, object]) -> list[str]:
    """Flags the release pins that the engine reports otherwise. A flag the engine does not report
    at all is a problem too: nothing can show it serves what the release names."""
    problems = []
    for name, want in sorted(expected.items()):
        if name not in server_info:
            problems.append(f"the engine does not report {name} (the release pins {want})")
            continue
        have = server_info[name]
        have_text = "none" if have is None else str(have).lower() if isinstance(have, bool) else str(have)
        if have_text != want:
            problems.append(f"the engine runs {name}={have_text}, the release pins {want}")
    return problems


def short(release_id: str) -> str:
    """The 12 hex a person reads (and may type: `store.resolve` accepts any unique prefix)."""
    return release_id.removeprefix("sha256:")[:12]
