"""Workload mixes: what requests look like, for the sweep, the planner and the fleet simulator.

A mix is a set of request classes, each with a weight, input and output length distributions and
the share of its prompt a prefix cache already holds. It comes from one of three places:

- a built-in name: `worked-example` (an assumed chat mix: 60% short chat 600 in / 250 out,
  60% cached; 30% multi-turn/RAG 3,000 / 400, 50% cached; 10% long 8,000 / 600, 10% cached);
- a YAML spec (see `docs/capacity.md`)::

      name: chat
      classes:
        - name: short chat
          weight: 0.6
          input_tokens: 600                                # a number is a fixed length
          output_tokens: {dist: lognormal, median: 200, p90: 450, max: 2000}
          cached_fraction: 0.6
        - name: rag
          weight: 0.4
          input_tokens: {dist: uniform, min: 2000, max: 4000}
          output_tokens: {dist: normal, mean: 400, std: 100, min: 1}
          cached_fraction: 0.5

- a trace file (the formats of `traces/`): every request of the trace is one equally likely sample,
  input and output lengths kept together. Mooncake traces carry prefix block ids, so their cached
  tokens are what an infinite cache replayed in time order would hold; Azure traces carry none, so
  `cached_fraction` (default 0) applies.

Pure: no I/O except reading the spec or trace; sampling takes the caller's `random.Random`.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.capacity import traces

# Samples used to compute the moments of distributions without a closed form (clipped ones).
_MOMENT_SAMPLES = 20_000
_Z90 = 1.2815515655446004  # standard normal 90th percentile


class MixError(ValueError):
    """A mix spec that cannot be used; the message names the offending field."""


@dataclass(frozen=True, slots=True)
class MixRequest:
    kind: str  # the class it was drawn from
    input_tokens: int
    output_tokens: int
    cached_tokens: int  # leading prompt tokens a prefix cache holds (always < input_tokens)

    @property
    def uncached_tokens(self) -> int:
        return self.input_tokens - self.cached_tokens


@dataclass(frozen=True)
class Length:
    """A token-length distribution: fixed, uniform, normal, lognormal or an explicit choice."""

    dist: str
    params: tuple[tuple[str, float], ...]
    low: int = 1
    high: int = 1_000_000

    @classmethod
    def parse(cls, spec: Any, where: str) -> Length:
        if isinstance(spec, bool):
            raise MixError(f"{where}: expected a number or a distribution, got {spec!r}")
        if isinstance(spec, int | float):
            if spec < 1:
                raise MixError(f"{where}: a length must be at least 1, got {spec}")
            return cls("fixed", (("value", float(round(spec))),))
        if not isinstance(spec, Mapping):
            raise MixError(f"{where}: expected a number or a mapping with `dist`, got {spec!r}")
        spec = dict(spec)
        dist = spec.pop("dist", None)
        low = int(spec.pop("min", 1))
        high = int(spec.pop("max", 1_000_000))
        if low < 1 or high < low:
            raise MixError(f"{where}: need 1 <= min <= max, got min={low} max={high}")
        required = {
            "fixed": ("value",), "uniform": ("low", "high"), "normal": ("mean", "std"),
            "lognormal": ("median", "p90"), "choice": ("values",),
        }
        if dist not in required:
            raise MixError(f"{where}: dist must be one of {sorted(required)}, got {dist!r}")
        if dist == "uniform":
            # min/max are the bounds of a uniform distribution; read them as such.
            spec.setdefault("low", low)
            spec.setdefault("high", high)
        missing = [name for name in required[dist] if name not in spec]
        if missing:
            raise MixError(f"{where}: dist {dist} needs {', '.join(missing)}")
        if dist == "choice":
            values = spec.pop("values")
            weights = spec.pop("weights", [1.0] * len(values))
            if not values or len(weights) != len(values) or any(v < 1 for v in values) or any(w < 0 for w in weights):
                raise MixError(f"{where}: choice needs positive values and one non-negative weight each")
            params = tuple((f"v{i}", float(v)) for i, v in enumerate(values)) + tuple(
                (f"w{i}", float(w)) for i, w in enumerate(weights))
        else:
            params = tuple((name, float(spec.pop(name))) for name in required[dist])
        if spec:
            raise MixError(f"{where}: unknown field(s) {', '.join(sorted(spec))} for dist {dist}")
        length = cls(dist, params, low, high)
        length._check(where)
        return length

    def _check(self, where: str) -> None:
        p = dict(self.params)
        if self.dist == "normal" and p["std"] < 0:
            raise MixError(f"{where}: std must not be negative")
        if self.dist == "lognormal" and not 0 < p["median"] <= p["p90"]:
            raise MixError(f"{where}: lognormal needs 0 < median <= p90")
        if self.dist == "uniform" and not 1 <= p["low"] <= p["high"]:
            raise MixError(f"{where}: uniform needs 1 <= min <= max")

    def sample(self, rng: random.Random) -> int:
        p = dict(self.params)
        if self.dist == "fixed":
            value = p["value"]
        elif self.dist == "uniform":
            value = rng.uniform(p["low"], p["high"])
        elif self.dist == "normal":
            value = rng.gauss(p["mean"], p["std"])
        elif self.dist == "lognormal":
            sigma = math.log(p["p90"] / p["median"]) / _Z90
            value = p["median"] * math.exp(sigma * rng.gauss(0.0, 1.0))
        else:
            count = len(self.params) // 2
            values = [p[f"v{i}"] for i in range(count)]
            value = rng.choices(values, weights=[p[f"w{i}"] for i in range(count)])[0]
        return min(self.high, max(self.low, round(value)))

    @property
    def mean(self) -> float:
        return self.moments()[0]

    def moments(self) -> tuple[float, float]:
        """Mean and mean square (exact for fixed lengths, from a seeded sample otherwise)."""
        if self.dist == "fixed":
            value = min(self.high, max(self.low, dict(self.params)["value"]))
            return value, value * value
        rng = random.Random(0)
        draws = [self.sample(rng) for _ in range(_MOMENT_SAMPLES)]
        return sum(draws) / len(draws), sum(d * d for d in draws) / len(draws)

    def describe(self) -> Any:
        params = dict(self.params)
        if self.dist == "fixed":
            return int(params["value"])
        shown: dict[str, Any] = params
        if self.dist == "choice":
            count = len(self.params) // 2
            shown = {"values": [int(params[f"v{i}"]) for i in range(count)],
                     "weights": [params[f"w{i}"] for i in range(count)]}
        elif self.dist == "uniform":
            return {"dist": self.dist, "min": int(params["low"]), "max": int(params["high"])}
        return {"dist": self.dist, **shown, "min": self.low, "max": self.high}


@dataclass(frozen=True)
class MixClass:
    """One kind of request, drawn independently: lengths from distributions."""

    name: str
    weight: float
    input_tokens: Length
    output_tokens: Length
    cached_fraction: float = 0.0

    def sample(self, rng: random.Random) -> MixRequest:
        n_in = self.input_tokens.sample(rng)
        cached = min(n_in - 1, int(n_in * self.cached_fraction))
        return MixRequest(self.name, n_in, self.output_tokens.sample(rng), max(0, cached))


@dataclass(frozen=True)
class TraceClass:
    """Requests of a trace, each an equally likely sample (lengths and cached tokens together)."""

    name: str
    weight: float
    rows: tuple[tuple[int, int, int], ...]  # (input, output, cached)

    def sample(self, rng: random.Random) -> MixRequest:
        n_in, n_out, cached = self.rows[rng.randrange(len(self.rows))]
        return MixRequest(self.name, n_in, n_out, cached)


@dataclass(frozen=True)
class Mix:
    name: str
    classes: tuple[MixClass | TraceClass, ...]
    source: str = "builtin"

    def __post_init__(self) -> None:
        if not self.classes:
            raise MixError(f"mix {self.name!r} has no classes")
        if any(c.weight < 0 for c in self.classes) or sum(c.weight for c in self.classes) <= 0:
            raise MixError(f"mix {self.name!r}: weights must be non-negative and not all zero")

    @property
    def shares(self) -> list[float]:
        total = sum(c.weight for c in self.classes)
        return [c.weight / total for c in self.classes]

    def sample(self, rng: random.Random) -> MixRequest:
        if len(self.classes) == 1:
            return self.classes[0].sample(rng)
        return rng.choices(self.classes, weights=[c.weight for c in self.classes])[0].sample(rng)

    def sample_many(self, n: int, seed: int = 0) -> list[MixRequest]:
        rng = random.Random(seed)
        return [self.sample(rng) for _ in range(n)]

    def uncached_quantile(self, q: float) -> float:
        """The q-quantile of a request's uncached prompt tokens (exact for fixed-length classes and traces).

        For the worked example 60% of requests prefill 240 tokens, 30% 1,500 and 10% 7,200, so
        the 90th-percentile request prefills 1,500 (the TTFT p90's prompt in the planner).
        """
        return self._quantile(q, cached=False)

    def input_quantile(self, q: float) -> float:
        """The q-quantile of a request's whole prompt, cached tokens included (the KV a
        disaggregated prefill sends its decode engine)."""
        return self._quantile(q, cached=True)

    def _quantile(self, q: float, *, cached: bool) -> float:
        if not 0 <= q <= 1:
            raise ValueError(f"q must be in [0, 1], got {q}")
        weighted: list[tuple[float, float]] = []

        def tokens(request: MixRequest) -> float:
            return float(request.input_tokens if cached else request.uncached_tokens)

        for share, cls in zip(self.shares, self.classes):
            if isinstance(cls, TraceClass):
                weighted += [(n_in if cached else n_in - hit, share / len(cls.rows)) for n_in, _, hit in cls.rows]
            elif cls.input_tokens.dist == "fixed":
                weighted.append((tokens(cls.sample(random.Random(0))), share))
            else:
                rng = random.Random(0)
                weighted += [(tokens(cls.sample(rng)), share / _MOMENT_SAMPLES) for _ in range(_MOMENT_SAMPLES)]
        weighted.sort()
        cumulative = 0.0
        for value, weight in weighted:
            cumulative += weight
            if cumulative >= q - 1e-9:  # 0.6 + 0.3 is 0.8999… in floating point
                return float(value)
        return float(weighted[-1][0])

    def stats(self) -> MixStats:
        """Means and second moments, per request, over the whole mix."""
        parts = []
        for share, cls in zip(self.shares, self.classes):
            parts.append((share, _class_stats(cls)))
        return MixStats(**{
            name: sum(share * getattr(s, name) for share, s in parts) for name in MixStats.__dataclass_fields__
        })

    @property
    def mean_input_tokens(self) -> float:
        return self.stats().input_tokens

    @property
    def mean_output_tokens(self) -> float:
        return self.stats().output_tokens

    @property
    def mean_cached_tokens(self) -> float:
        return self.stats().cached_tokens

    @property
    def mean_uncached_tokens(self) -> float:
        stats = self.stats()
        return stats.input_tokens - stats.cached_tokens

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary: what the mix is and its means (reports carry it)."""
        stats = self.stats()
        classes = []
        for share, cls in zip(self.shares, self.classes):
            if isinstance(cls, MixClass):
                classes.append({
                    "name": cls.name, "share": round(share, 6), "input_tokens": cls.input_tokens.describe(),
                    "output_tokens": cls.output_tokens.describe(), "cached_fraction": cls.cached_fraction,
                })
            else:
                classes.append({"name": cls.name, "share": round(share, 6), "trace_requests": len(cls.rows)})
        return {
            "name": self.name, "source": self.source, "classes": classes,
            "mean_input_tokens": round(stats.input_tokens, 1), "mean_output_tokens": round(stats.output_tokens, 1),
            "mean_cached_tokens": round(stats.cached_tokens, 1),
        }


@dataclass(frozen=True)
class MixStats:
    input_tokens: float
    output_tokens: float
    cached_tokens: float
    uncached_sq: float  # E[uncached²]: the prefill service time's second moment (M/G/1 waits)
    # Token-weighted mean context a prefill token attends to, times uncached tokens (sum form, so
    # that mixing classes stays linear): E[uncached · (cached + input) / 2].
    prefill_ctx_weighted: float
    # E[output · (input + output / 2)]: a decoding sequence's context, weighted by its steps.
    decode_ctx_weighted: float
    # E[input² · output + input · output² + output³ / 3] = E[∫₀ᵒ (input + t)² dt]: the second moment
    # of a decoding sequence's context, weighted by its steps (how far the KV a batch holds spreads).
    decode_ctx_sq_weighted: float = 0.0
    input_sq: float = 0.0  # E[input²]: how far the KV reserved for prompts on their way in spreads

    @property
    def uncached_tokens(self) -> float:
        return self.input_tokens - self.cached_tokens

    @property
    def prefill_ctx_tokens(self) -> float:
        """Mean context a prefill token attends to (token-weighted)."""
        return self.prefill_ctx_weighted / self.uncached_tokens if self.uncached_tokens else 0.0

    @property
    def decode_ctx_tokens(self) -> float:
        """Mean resident context of a decoding sequence (time-weighted: weighted by output tokens)."""
        return self.decode_ctx_weighted / self.output_tokens if self.output_tokens else 0.0

    @property
    def decode_ctx_sq(self) -> float:
        """E[c²] of a decoding sequence's resident context (time-weighted, as `decode_ctx_tokens`)."""
        return self.decode_ctx_sq_weighted / self.output_tokens if self.output_tokens else 0.0


def _class_stats(cls: MixClass | TraceClass) -> MixStats:
    if isinstance(cls, MixClass) and cls.input_tokens.dist == "fixed" and cls.output_tokens.dist == "fixed":
        rows: Sequence[tuple[int, int, int]] = [_row(cls.sample(random.Random(0)))]
    elif isinstance(cls, MixClass):
        rng = random.Random(0)
        rows = [_row(cls.sample(rng)) for _ in range(_MOMENT_SAMPLES)]
    else:
        rows = cls.rows
    n = len(rows)
    return MixStats(
        input_tokens=sum(r[0] for r in rows) / n,
        output_tokens=sum(r[1] for r in rows) / n,
        cached_tokens=sum(r[2] for r in rows) / n,
        uncached_sq=sum((r[0] - r[2]) ** 2 for r in rows) / n,
        prefill_ctx_weighted=sum((r[0] - r[2]) * (r[2] + r[0]) / 2 for r in rows) / n,
        decode_ctx_weighted=sum(r[1] * (r[0] + r[1] / 2) for r in rows) / n,
        decode_ctx_sq_weighted=sum(r[0] ** 2 * r[1] + r[0] * r[1] ** 2 + r[1] ** 3 / 3 for r in rows) / n,
        input_sq=sum(r[0] ** 2 for r in rows) / n,
    )


def _row(request: MixRequest) -> tuple[int, int, int]:
    return request.input_tokens, request.output_tokens, request.cached_tokens


def worked_example() -> Mix:
    """The worked example's assumed chat mix: mean 2,060 input and 330 output tokens."""
    return Mix("worked-example", (
        MixClass("short chat", 0.6, Length.parse(600, "short chat"), Length.parse(250, "short chat"), 0.6),
        MixClass("multi-turn/RAG", 0.3, Length.parse(3000, "rag"), Length.parse(400, "rag"), 0.5),
        MixClass("long", 0.1, Length.parse(8000, "long"), Length.parse(600, "long"), 0.1),
    ))


BUILTIN = {"worked-example": worked_example}


def from_spec(spec: Mapping[str, Any], source: str = "spec") -> Mix:
    """A mix from a parsed YAML/JSON mapping (see the module docstring)."""
    if not isinstance(spec, Mapping):
        raise MixError(f"{source}: a mix spec is a mapping with `classes`")
    unknown = set(spec) - {"name", "classes"}
    if unknown:
        raise MixError(f"{source}: unknown field(s) {', '.join(sorted(unknown))}")
    raw_classes = spec.get("classes")
    if not isinstance(raw_classes, list) or not raw_classes:
        raise MixError(f"{source}: `classes` must be a non-empty list")
    classes = []
    for i, raw in enumerate(raw_classes):
        where = f"{source}: classes[{i}]"
        if not isinstance(raw, Mapping):
            raise MixError(f"{where}: expected a mapping")
        raw = dict(raw)
        name = str(raw.pop("name", f"class {i}"))
        where = f"{source}: class {name!r}"
        weight = raw.pop("weight", 1.0)
        cached = raw.pop("cached_fraction", 0.0)
        if "input_tokens" not in raw or "output_tokens" not in raw:
            raise MixError(f"{where}: needs input_tokens and output_tokens")
        n_in = Length.parse(raw.pop("input_tokens"), f"{where} input_tokens")
        n_out = Length.parse(raw.pop("output_tokens"), f"{where} output_tokens")
        if raw:
            raise MixError(f"{where}: unknown field(s) {', '.join(sorted(raw))}")
        if not isinstance(weight, int | float) or weight < 0:
            raise MixError(f"{where}: weight must be a non-negative number")
        if not isinstance(cached, int | float) or not 0 <= cached < 1:
            raise MixError(f"{where}: cached_fraction must be in [0, 1)")
        classes.append(MixClass(name, float(weight), n_in, n_out, float(cached)))
    return Mix(str(spec.get("name", Path(source).stem)), tuple(classes), source)


def from_trace(path: str | Path, cached_fraction: float | None = None) -> Mix:
    """A mix whose samples are the requests of a trace file (see the module docstring)."""
    path = Path(path)
    requests = traces.load(path)
    if not requests:
        raise MixError(f"{path}: the trace has no requests")
    if cached_fraction is not None and not 0 <= cached_fraction < 1:
        raise MixError("cached_fraction must be in [0, 1)")
    has_blocks = any(r.hash_ids for r in requests)
    if has_blocks and cached_fraction is None:
        cache: OrderedDict[int, None] = OrderedDict()
        cached = [traces.replay_blocks(r, cache) for r in requests]
    else:
        cached = [int(r.input_tokens * (cached_fraction or 0.0)) for r in requests]
    rows = tuple(
        (r.input_tokens, r.output_tokens, max(0, min(r.input_tokens - 1, hit)))
        for r, hit in zip(requests, cached)
        if r.input_tokens >= 1 and r.output_tokens >= 1
    )
    if not rows:
        raise MixError(f"{path}: no request with at least one input and one output token")
    return Mix(path.stem, (TraceClass(path.stem, 1.0, rows),), str(path))


TRACE_SUFFIXES = (".jsonl", ".csv")


def load(name_or_path: str | Path, cached_fraction: float | None = None) -> Mix:
    """A built-in mix name, a YAML/JSON spec or a trace file (`.jsonl`, `.csv`)."""
    text = str(name_or_path)
    if text in BUILTIN:
        return BUILTIN[text]()
    path = Path(text)
    if not path.exists():
        raise MixError(f"no mix {text!r}: not a built-in ({', '.join(BUILTIN)}) and no such file")
    if path.suffix in TRACE_SUFFIXES:
        return from_trace(path, cached_fraction)
    if path.suffix in (".yaml", ".yml", ".json"):
        import yaml  # JSON is YAML

        try:
            spec = yaml.safe_load(path.read_text())
        except yaml.YAMLError as error:
            raise MixError(f"{path}: not valid YAML: {error}") from error
        return from_spec(spec, str(path))
    raise MixError(f"{path}: unknown mix format (expected .yaml, .yml, .json, .jsonl or .csv)")
