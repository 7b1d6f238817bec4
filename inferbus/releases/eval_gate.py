"""The eval gate: suites of prompts with graders, scores, and candidate-vs-baseline verdicts.

A suite is JSONL. Its first line may be a header, `{"suite": "<name>", "threshold": 0.05,
"repeats": 25, "temperature": 0.6}`; every other line is one item: `messages` (a chat) or `prompt`
(a completion), optional `max_tokens` and `response_format`, and a `grader`:

    {"type": "exact", "expected": "42"}                      the answer, stripped, equals it
    {"type": "contains", "expected": "42"}                   the answer contains it
    {"type": "regex", "pattern": "^-?\\d+$"}                 the stripped answer matches (re.fullmatch)
    {"type": "json_schema", "schema": {...}}                  the answer is JSON valid under the schema
    {"type": "numeric", "expected": 42, "tolerance": 0.5}    the first number in it is within tolerance

A release's score is the share of its graded answers that pass, over every item and repeat (each
repeat sends its own sampling seed, so repeats sample the model rather than replay one draw; with
temperature 0 a real engine answers the same, so repeat only when sampling). The verdict compares
two scores with a 95% confidence interval on their difference (Newcombe's hybrid score interval,
from Wilson intervals: sound at scores near 0 or 1 where the normal approximation is not):

- fail: the interval lies below -threshold (the candidate is surely worse by more than allowed);
- pass: the interval lies above -threshold (whatever it lost, it surely lost less);
- inconclusive: neither (more repeats narrow the interval); the canary holds, it does not promote.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import jsonschema

GRADERS = ("exact", "contains", "regex", "json_schema", "numeric")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
Z95 = 1.959964


class SuiteError(ValueError):
    pass


@dataclass
class Item:
    id: str
    grader: dict[str, Any]
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    max_tokens: int = 32
    response_format: dict[str, Any] | None = None


@dataclass
class Suite:
    name: str
    items: list[Item]
    threshold: float = 0.05  # the largest score drop allowed (absolute: 0.05 is 5 points)
    repeats: int = 10
    temperature: float = 0.6


def _check_grader(grader: Any, where: str) -> dict[str, Any]:
    if not isinstance(grader, dict) or grader.get("type") not in GRADERS:
        raise SuiteError(f"{where}: grader must be an object with type one of {', '.join(GRADERS)}")
    kind = grader["type"]
    needs = {"exact": "expected", "contains": "expected", "regex": "pattern", "json_schema": "schema",
             "numeric": "expected"}[kind]
    if needs not in grader:
        raise SuiteError(f"{where}: a {kind} grader needs {needs!r}")
    if kind == "regex":
        try:
            re.compile(grader["pattern"])
        except re.error as error:
            raise SuiteError(f"{where}: bad pattern: {error}") from None
    if kind == "json_schema":
        try:
            jsonschema.Draft202012Validator.check_schema(grader["schema"])
        except jsonschema.SchemaError as error:
            raise SuiteError(f"{where}: bad schema: {error.message}") from None
    if kind == "numeric" and not isinstance(grader.get("tolerance", 0), (int, float)):
        raise SuiteError(f"{where}: tolerance must be a number")
    return grader


def parse_suite(text: str, name: str) -> Suite:
    suite = Suite(name=name, items=[])
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name} line {number}"
        try:
            row = json.loads(line)
        except ValueError as error:
            raise SuiteError(f"{where}: not JSON ({error})") from None
        if "suite" in row:
            suite.name = str(row["suite"])
            suite.threshold = float(row.get("threshold", suite.threshold))
            suite.repeats = int(row.get("repeats", suite.repeats))
            suite.temperature = float(row.get("temperature", suite.temperature))
            continue
        if ("messages" in row) == ("prompt" in row):
            raise SuiteError(f"{where}: give messages or prompt")
        suite.items.append(
            Item(
                id=str(row.get("id", number)),
                grader=_check_grader(row.get("grader"), where),
                messages=row.get("messages"),
                prompt=row.get("prompt"),
                max_tokens=int(row.get("max_tokens", 32)),
                response_format=row.get("response_format"),
            )
        )
    if not suite.items:
        raise SuiteError(f"{name}: no items")
    if not 0 < suite.threshold < 1 or suite.repeats < 1:
        raise SuiteError(f"{name}: threshold must be in (0, 1) and repeats at least 1")
    return suite


def load_suite(reference: str) -> Suite:
    """A suite from a file path, or by the name of one shipped with inferbus (`arithmetic`)."""
    path = Path(reference)
    if path.is_file():
        return parse_suite(path.read_text(), path.stem)
    shipped = resources.files("inferbus.releases") / "suites" / f"{reference}.jsonl"
    if shipped.is_file():
        return parse_suite(shipped.read_text(), reference)
    raise SuiteError(f"no suite {reference!r}: give a JSONL file or one of: {', '.join(shipped_suites())}")


def shipped_suites() -> list[str]:
    folder = resources.files("inferbus.releases") / "suites"
    return sorted(entry.name.removesuffix(".jsonl") for entry in folder.iterdir() if entry.name.endswith(".jsonl"))


def grade(grader: dict[str, Any], answer: str) -> bool:
    kind = grader["type"]
    text = answer.strip()
    if kind == "exact":
        return text == str(grader["expected"]).strip()
    if kind == "contains":
        return str(grader["expected"]) in answer
    if kind == "regex":
        return re.fullmatch(grader["pattern"], text) is not None
    if kind == "json_schema":
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return jsonschema.Draft202012Validator(grader["schema"]).is_valid(value)
    if kind == "numeric":
        found = _NUMBER.search(text)
        if found is None:
            return False
        return abs(float(found.group()) - float(grader["expected"])) <= float(grader.get("tolerance", 0))
    raise SuiteError(f"unknown grader {kind!r}")


def wilson(passed: int, n: int, z: float = Z95) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = passed / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def difference_interval(cand_passed: int, cand_n: int, base_passed: int, base_n: int) -> tuple[float, float]:
    """95% interval of (candidate score - baseline score), Newcombe's method 10."""
    p1, p2 = cand_passed / cand_n, base_passed / base_n
    l1, u1 = wilson(cand_passed, cand_n)
    l2, u2 = wilson(base_passed, base_n)
    d = p1 - p2
    return d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


@dataclass(frozen=True)
class EvalVerdict:
    outcome: Literal["pass", "fail", "inconclusive"]
    candidate_score: float
    baseline_score: float
    low: float
    high: float
    reason: str


def compare(
    cand_passed: int, cand_n: int, base_passed: int, base_n: int, threshold: float, suite: str = ""
) -> EvalVerdict:
    if cand_n == 0 or base_n == 0:
        raise ValueError("both releases need graded answers")
    low, high = difference_interval(cand_passed, cand_n, base_passed, base_n)
    c, b = cand_passed / cand_n, base_passed / base_n
    summary = (
        f"suite {suite}: candidate {c:.1%} ({cand_passed}/{cand_n}) vs baseline {b:.1%} ({base_passed}/{base_n}), "
        f"difference {c - b:+.1%}, 95% CI [{low:+.1%}, {high:+.1%}], allowed drop {threshold:.1%}"
    )
    if high < -threshold:
        return EvalVerdict("fail", c, b, low, high, summary + ": worse beyond the allowed drop")
    if low > -threshold:
        return EvalVerdict("pass", c, b, low, high, summary)
    return EvalVerdict("inconclusive", c, b, low, high, summary + ": not conclusive, run more repeats")


@dataclass
class Score:
    passed: int = 0
    graded: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)  # (item id, answer) of wrong answers, a few

    def add(self, item: Item, answer: str) -> None:
        self.graded += 1
        if grade(item.grader, answer):
            self.passed += 1
        elif len(self.failures) < 5:
            self.failures.append((item.id, answer))
