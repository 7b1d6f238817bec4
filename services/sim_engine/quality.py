"""The simulated model's answer quality on one recognisable class of prompts: integer arithmetic.

A prompt asking `What is 17 + 25?` (also `Compute`/`Calculate`; `+`, `-`, `*`) is answered with
the number alone, right with probability `eval_accuracy` and off by a small amount otherwise,
drawn from the request's sampling seed (else its rid), so repeated runs of an eval suite sample
the accuracy instead of replaying one draw. Everything else is answered as before. This is what
lets eval gates be tested: a model directory (or `--eval-accuracy`) sets the accuracy, so an
"FP8 candidate" a point worse and a broken checkpoint twenty points worse are both simulated.

Per model directory: `inferbus_sim.json` with `{"eval_accuracy": 0.9}`; the flag overrides it.
A LoRA adapter's directory may hold its own `inferbus_sim.json`: requests with that adapter are
answered at its accuracy (a tenant's new adapter version that is better or worse), others at the
model's.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

SIM_FILE = "inferbus_sim.json"
DEFAULT_ACCURACY = 0.95
_QUESTION = re.compile(r"(?:What is|Compute|Calculate)\s+(-?\d{1,9})\s*([+*-])\s*(-?\d{1,9})\s*[?=]", re.IGNORECASE)


def accuracy_of(model_dir: str | None, flag: float | None) -> float:
    """The flag if given, else the model directory's `inferbus_sim.json`, else the default."""
    if flag is not None:
        return flag
    if model_dir:
        path = Path(model_dir) / SIM_FILE
        if path.is_file():
            value = float(json.loads(path.read_text()).get("eval_accuracy", DEFAULT_ACCURACY))
            if not 0 <= value <= 1:
                raise ValueError(f"{path}: eval_accuracy must be in [0, 1], got {value}")
            return value
    return DEFAULT_ACCURACY


def adapter_accuracy(adapter_dir: str, base: float) -> float:
    """The accuracy of requests with the adapter at `adapter_dir`: its own, else the model's."""
    if Path(adapter_dir, SIM_FILE).is_file():
        return accuracy_of(adapter_dir, None)
    return base


def write_accuracy(model_dir: str | Path, accuracy: float) -> Path:
    """Set a model directory's simulated accuracy (a test checkpoint that is better or worse)."""
    path = Path(model_dir) / SIM_FILE
    path.write_text(json.dumps({"eval_accuracy": accuracy}) + "\n")
    return path


def answer(text: str, accuracy: float, seed: object) -> str | None:
    """The model's answer to an arithmetic question in the prompt's last user turn, or None."""
    matches = list(_QUESTION.finditer(text))
    if not matches:
        return None
    left, op, right = matches[-1].groups()
    a, b = int(left), int(right)
    correct = a + b if op == "+" else a - b if op == "-" else a * b
    rng = random.Random(f"{seed}")
    if rng.random() < accuracy:
        return str(correct)
    return str(correct + rng.choice((-10, -2, -1, 1, 2, 10)))
