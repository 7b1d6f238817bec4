"""What SGLang checks in an adapter directory before loading it, for adapters on this machine.

The simulator has no weights to load, but a PEFT adapter directory that exists locally says its
rank in `adapter_config.json`; SGLang refuses an adapter whose rank exceeds `--max-lora-rank`
(400, with the message below), and so does this.
Paths that are not local directories are judged by `lora_pool.lora_path_exists` instead.
"""

from __future__ import annotations

import json
from pathlib import Path


def adapter_problem(name: str, path: str, max_rank: int | None) -> str | None:
    """SGLang's message refusing the adapter at `path`, or None when it would load (or is not local)."""
    directory = Path(path)
    if not directory.is_dir():
        return None
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
    except (OSError, ValueError) as error:
        return f"Failed to load LoRA adapter {name}: no readable adapter_config.json in {path} ({error})"
    rank = int(config.get("r", 0))
    if max_rank is None or rank <= max_rank:
        return None
    return (
        f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool configuration. "
        "Please ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` and that the "
        "target modules are included in `--lora-target-modules`."
    )
