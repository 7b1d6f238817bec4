"""One settings object per service, read from environment variables.

Each service declares a frozen dataclass whose fields carry their env var name and help text in
`field(metadata=...)`; `load()` fills it from the environment, `describe()` lists the variables
(used by `--help` and docs/configuration.md).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, TypeVar

T = TypeVar("T")


def env(name: str, default: Any, help: str, formerly: str | None = None, shared: bool = False) -> Any:
    """Declare a settings field bound to environment variable `name` (or, when `name` is not set,
    to `formerly`: the variable's name before a rename, so existing deployments keep working).
    `shared`: one of the declarations below, which several services read."""
    metadata = (
        {"env": name, "help": help}
        | ({"formerly": formerly} if formerly else {})
        | ({"shared": True} if shared else {})
    )
    return dataclasses.field(default=default, metadata=metadata)


def _parse(raw: str, kind: Any, name: str) -> Any:
    kind = kind if isinstance(kind, type) else {"int": int, "float": float, "bool": bool, "str": str}.get(
        str(kind).split("|")[0].strip(), str
    )
    try:
        if kind is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        return kind(raw)
    except ValueError:
        raise SystemExit(f"invalid value for {name}: {raw!r} (expected {kind.__name__})") from None


def load(cls: type[T], **overrides: Any) -> T:
    """Build `cls` from its defaults, then the environment, then explicit `overrides`."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        name = f.metadata.get("env")
        formerly = f.metadata.get("formerly")
        if name and name not in os.environ and formerly and formerly in os.environ:
            name = formerly
        if name and name in os.environ:
            values[f.name] = _parse(os.environ[name], f.type, name)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)


def describe(cls: type) -> list[tuple[str, Any, str]]:
    """(env var, default, help) for every field of a settings class."""
    return [
        (f.metadata["env"], f.default, f.metadata.get("help", ""))
        for f in dataclasses.fields(cls)
        if "env" in f.metadata
    ]


# Settings several services read, each declared once here: its variable, its default and what it
# is. A service's settings class takes the declaration as its field and may add what the value
# means to that service. A default that differed between two services would make a platform whose
# parts disagree (a heartbeat judged dead by one and alive by another) the moment one is changed.

HEARTBEAT_TTL_S = 3.0
MODEL = "meta-llama/Llama-3.3-70B-Instruct"
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_JSON_DEPTH = 128
DEFAULT_MAX_TOKENS = 4096
_REDIS_FORMS = "with its password `redis://:PASSWORD@HOST:6379/0`, TLS `rediss://`"


def _shared(name: str, default: Any, help: str) -> Any:
    return env(name, default, help, shared=True)


def nats_url(text: str = "NATS server (2.11+ with JetStream).") -> Any:
    return _shared("NATS_URL", "nats://127.0.0.1:4222", text)


def redis_url(holding: str) -> Any:
    return _shared("REDIS_URL", "redis://127.0.0.1:6379/0", f"Redis holding {holding}; {_REDIS_FORMS}.")


def model(meaning: str) -> Any:
    return _shared("INFERBUS_MODEL", MODEL, meaning)


def heartbeat_ttl_s(meaning: str) -> Any:
    return _shared("INFERBUS_HEARTBEAT_TTL_S", HEARTBEAT_TTL_S, meaning)


def liveness_timeout_s(meaning: str) -> Any:
    return _shared("INFERBUS_LIVENESS_TIMEOUT_S", 1.0, meaning)


def block_size(default: int, meaning: str) -> Any:
    """`default`: the tokenizer module's (this floor does not import it)."""
    return _shared("INFERBUS_BLOCK_SIZE", default, f"Prefix block size in tokens; {meaning}")


def zone(whose: str) -> Any:
    return _shared(
        "INFERBUS_ZONE",
        "",
        f"Failure domain (availability zone) {whose} runs in; the router prefers workers of "
        "the asking gateway's zone and spills to other zones when that zone is full or gone. Empty: no zone.",
    )


def zone_file(whose: str) -> Any:
    return _shared(
        "INFERBUS_ZONE_FILE",
        "",
        f"File holding {whose} zone, used when INFERBUS_ZONE is empty: in Kubernetes "
        "the `zone` init container writes the node's topology.kubernetes.io/zone label there (inferbus "
        "node-zone). Empty: none.",
    )


def state_dir(holding: str) -> Any:
    return _shared(
        "INFERBUS_STATE_DIR", ".inferbus/state", f"Directory of this service's durable local state ({holding})."
    )


def max_body_bytes(meaning: str) -> Any:
    return _shared("INFERBUS_MAX_BODY_BYTES", MAX_BODY_BYTES, meaning)


def max_json_depth(meaning: str) -> Any:
    return _shared("INFERBUS_MAX_JSON_DEPTH", MAX_JSON_DEPTH, meaning)


def default_max_tokens(meaning: str) -> Any:
    return _shared("INFERBUS_DEFAULT_MAX_TOKENS", DEFAULT_MAX_TOKENS, meaning)


def metrics_port(port: int, whose: str) -> Any:
    return _shared("INFERBUS_METRICS_PORT", port, f"Port of {whose} Prometheus /metrics (0 disables).")


def log_level() -> Any:
    return _shared("INFERBUS_LOG_LEVEL", "info", "Log level.")


def otel_exporter() -> Any:
    return _shared("INFERBUS_OTEL_EXPORTER", "none", "Span exporter: none, console or otlp.")


def model_dir(meaning: str) -> Any:
    return _shared("INFERBUS_MODEL_DIR", "", meaning)


def max_model_len(meaning: str) -> Any:
    return _shared("INFERBUS_MAX_MODEL_LEN", 0, meaning)


def placement_patience_ms(meaning: str) -> Any:
    return _shared("INFERBUS_PLACEMENT_PATIENCE_MS", 1000.0, meaning)


def files_dir(meaning: str) -> Any:
    return _shared("INFERBUS_FILES_DIR", ".inferbus/files", meaning)


# The list prices the billing service seeds its price book with once, and the gateway budgets with.
def price_input_per_mtok(meaning: str) -> Any:
    return _shared("INFERBUS_PRICE_INPUT_PER_MTOK", 0.60, meaning)


def price_cached_input_per_mtok(meaning: str) -> Any:
    return _shared("INFERBUS_PRICE_CACHED_INPUT_PER_MTOK", 0.15, meaning)


def price_output_per_mtok(meaning: str) -> Any:
    return _shared("INFERBUS_PRICE_OUTPUT_PER_MTOK", 0.90, meaning)
