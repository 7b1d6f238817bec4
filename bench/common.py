"""What every benchmark shares: percentiles and writing results as JSON and markdown."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.capacity.stats import percentile  # noqa: F401  (re-exported)


def write_results(out: Path, name: str, results: dict[str, Any], markdown: Callable[[dict[str, Any]], str]) -> None:
    """`<out>/<name>.json` with every number and `<out>/<name>.md` with the tables; prints the tables."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    text = markdown(results)
    (out / f"{name}.md").write_text(text)
    print(text)
