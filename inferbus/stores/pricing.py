"""What tokens cost: prices per model and adapter, versioned by effective time. Pure: no I/O, no clock.

- `Prices`: dollars per 1M tokens for uncached input, cached input and output, plus the discount
  batch requests get. `Prices.cost` (a float, undiscounted) is what admission reserves up front;
  `Prices.line_costs` is what a request is billed, in integer micro-dollars, so sums are exact.
- `PriceBook`: every price version. `price_at(model, adapter, ts)` is the version in force at `ts`
  for the most specific entry that has one, so a price change applies from its effective time on
  and the periods before it keep their prices (replaying the ledger reproduces every amount).

Money is integer micro-dollars (µ$) everywhere it is summed. A request's cost per token kind is
`tokens × price × (1 − discount)` rounded half-to-even to the micro-dollar; its cost is the sum of
its three kinds, and every total (rollups, `/v1/costs`, exports, the monthly budget) is a sum of
those integers. Prices are accepted with at most 6 decimals in dollars per 1M tokens, and the
discount with at most 6 decimals, so the arithmetic below is exact integer arithmetic.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from functools import cached_property
from typing import Any, NamedTuple

MICRO = 1_000_000
_SCALE = MICRO * MICRO  # (1M tokens) × (1M millionths of the discount)
ANY = "*"  # matches every model, or every adapter (the base model included)
BASE = ""  # the adapter key of the base model without an adapter


class InvalidPrice(ValueError):
    """A price, discount or price-book entry that cannot be used; `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def to_micro(value: float | str | Decimal, what: str = "price") -> int:
    """`value` (dollars, or a fraction for a discount) times 10^6, exactly; at most 6 decimals."""
    try:
        number = Decimal(str(value))
    except InvalidOperation:
        raise InvalidPrice(f"{what} must be a number, not {value!r}", what) from None
    if not number.is_finite() or number < 0:
        raise InvalidPrice(f"{what} must be a finite number >= 0, not {value}", what)
    scaled = number * MICRO
    if scaled != scaled.to_integral_value():
        raise InvalidPrice(f"{what} has more than 6 decimals: {value}", what)
    return int(scaled)


_line_costs = tuple.__new__


class LineCosts(NamedTuple):
    """What one request costs, per token kind, in micro-dollars."""

    input: int  # uncached prompt tokens
    cached_input: int
    output: int

    @property
    def total(self) -> int:
        return self.input + self.cached_input + self.output


@dataclass(frozen=True)
class Prices:
    """Dollars per 1M tokens. Positional order (input, output, cached input) is kept for callers."""

    input_per_mtok: float
    output_per_mtok: float
    cached_input_per_mtok: float
    batch_discount: float = 0.0  # fraction off for requests of a batch (0.5 = half price)

    def __post_init__(self) -> None:
        for name in ("input_per_mtok", "output_per_mtok", "cached_input_per_mtok", "batch_discount"):
            to_micro(getattr(self, name), name)  # validates: finite, >= 0, at most 6 decimals
        if self.batch_discount > 1:
            raise InvalidPrice(f"batch_discount must be between 0 and 1, not {self.batch_discount}", "batch_discount")

    def cost(self, input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> float:
        """Undiscounted dollars, as a float: admission's up-front estimate."""
        uncached = max(0, input_tokens - cached_tokens)
        return (uncached * self.input_per_mtok + cached_tokens * self.cached_input_per_mtok
                + output_tokens * self.output_per_mtok) / 1e6

    @cached_property
    def _micro(self) -> tuple[int, int, int, int]:
        return (to_micro(self.input_per_mtok), to_micro(self.cached_input_per_mtok), to_micro(self.output_per_mtok),
                to_micro(self.batch_discount))

    def line_costs(self, input_tokens: int, output_tokens: int, cached_tokens: int = 0,
                   batch: bool = False) -> LineCosts:
        """Billed micro-dollars per token kind; `input_tokens` includes the cached ones.

        tokens × (µ$ per 1M tokens) × (millionths kept after the discount) / 10^12 (or, without a
        discount, tokens × µ$ per 1M tokens / 10^6), rounded half to even; written out inline
        because the rollup prices every event of the platform.
        """
        p_in, p_cached, p_out, discount = self._micro
        if input_tokens < 0:
            input_tokens = 0
        if output_tokens < 0:
            output_tokens = 0
        cached = cached_tokens if 0 <= cached_tokens <= input_tokens else (0 if cached_tokens < 0 else input_tokens)
        if batch and discount:
            factor, scale = MICRO - discount, _SCALE
        else:
            factor, scale = 1, MICRO
        half = scale // 2  # scale is even: a remainder equal to it is an exact tie
        q1, r = divmod((input_tokens - cached) * p_in * factor, scale)
        if r > half or (r == half and q1 & 1):
            q1 += 1
        q2, r = divmod(cached * p_cached * factor, scale)
        if r > half or (r == half and q2 & 1):
            q2 += 1
        q3, r = divmod(output_tokens * p_out * factor, scale)
        if r > half or (r == half and q3 & 1):
            q3 += 1
        return _line_costs(LineCosts, (q1, q2, q3))

    def cost_micro(self, input_tokens: int, output_tokens: int, cached_tokens: int = 0, batch: bool = False) -> int:
        return self.line_costs(input_tokens, output_tokens, cached_tokens, batch).total

    def to_dict(self) -> dict[str, float]:
        return {"input": self.input_per_mtok, "cached_input": self.cached_input_per_mtok,
                "output": self.output_per_mtok, "batch_discount": self.batch_discount}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Prices:
        try:
            return cls(float(data["input"]), float(data["output"]), float(data["cached_input"]),
                       float(data.get("batch_discount", 0.0)))
        except KeyError as missing:
            raise InvalidPrice(f"missing price `{missing.args[0]}`", str(missing.args[0])) from None
        except (TypeError, ValueError) as error:
            if isinstance(error, InvalidPrice):
                raise
            raise InvalidPrice(f"prices must be numbers: {error}") from None


@dataclass(frozen=True)
class PriceVersion:
    """One entry of the price book: `prices` apply to (model, adapter) from `effective` on."""

    model: str  # a model id, or "*" for every model
    adapter: str  # an adapter name, "" for the base model without adapter, "*" for any
    effective: float  # unix seconds
    prices: Prices
    created: float = 0.0  # when it was stored (informational)

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidPrice("model must not be empty (use `*` for every model)", "model")
        if not math.isfinite(self.effective):
            raise InvalidPrice("effective must be a finite unix time", "effective")
        for name in ("model", "adapter"):
            if any(ch in getattr(self, name) for ch in "\t\n\x1e\x1f"):
                raise InvalidPrice(f"{name} contains a control character", name)

    @property
    def key(self) -> tuple[str, str]:
        return self.model, self.adapter

    def field(self) -> str:
        """The entry's identity in storage: one version per (model, adapter, effective)."""
        return f"{self.model}\t{self.adapter}\t{self.effective!r}"

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "adapter": self.adapter, "effective": self.effective,
                "created": self.created, **self.prices.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PriceVersion:
        if not isinstance(data, dict):
            raise InvalidPrice("a price version must be a JSON object")
        for name in data:
            if name not in _VERSION_FIELDS:
                raise InvalidPrice(f"unknown price field `{name}`", str(name))
        try:
            effective = float(data.get("effective", 0.0))
        except (TypeError, ValueError):
            raise InvalidPrice("effective must be a unix time in seconds", "effective") from None
        model, adapter = data.get("model", ANY), data.get("adapter", ANY)
        if not isinstance(model, str) or not isinstance(adapter, str):
            raise InvalidPrice("model and adapter must be strings", "model")
        return cls(model=model, adapter=adapter, effective=effective, prices=Prices.from_dict(data),
                   created=float(data.get("created", 0.0) or 0.0))


_VERSION_FIELDS = frozenset({"model", "adapter", "effective", "created", "input", "cached_input", "output",
                             "batch_discount"})


class NoPrice(LookupError):
    pass


@dataclass
class PriceBook:
    """Every price version; `default` applies where no entry does (before the first, or unmatched)."""

    versions: list[PriceVersion] = field(default_factory=list)
    default: Prices | None = None

    def __post_init__(self) -> None:
        by_key: dict[tuple[str, str], dict[float, PriceVersion]] = {}
        for version in self.versions:
            by_key.setdefault(version.key, {})[version.effective] = version  # the last given wins
        self.versions = sorted((v for per in by_key.values() for v in per.values()),
                               key=lambda v: (v.model, v.adapter, v.effective))
        self._timelines: dict[tuple[str, str], tuple[list[float], list[Prices]]] = {}
        for (model, adapter), per in by_key.items():
            ordered = sorted(per.values(), key=lambda v: v.effective)
            self._timelines[(model, adapter)] = ([v.effective for v in ordered], [v.prices for v in ordered])
        self._candidates: dict[tuple[str, str], list[tuple[list[float], list[Prices]]]] = {}
        self._segments: dict[tuple[str, str], tuple[float, float, Prices]] = {}

    def _lookup_order(self, model: str, adapter: str) -> list[tuple[list[float], list[Prices]]]:
        key = (model, adapter)
        found = self._candidates.get(key)
        if found is None:
            # Most specific first: exact model beats "*", then exact adapter beats "*".
            keys = [(model, adapter), (model, ANY), (ANY, adapter), (ANY, ANY)]
            seen: list[tuple[str, str]] = []
            for k in keys:
                if k not in seen:
                    seen.append(k)
            found = [self._timelines[k] for k in seen if k in self._timelines]
            if len(self._candidates) > 10_000:
                self._candidates.clear()
            self._candidates[key] = found
        return found

    def price_at(self, model: str, adapter: str | None, ts: float) -> Prices:
        """The prices in force at `ts` for (model, adapter): the most specific entry with a version
        effective at or before `ts`, else the default. NoPrice if there is neither."""
        key = (model, adapter or BASE)
        segment = self._segments.get(key)
        if segment is not None and segment[0] <= ts < segment[1]:
            return segment[2]  # the events of a batch mostly fall in one segment: no search
        found: Prices | None = None
        start, end = -math.inf, math.inf
        for effectives, prices in self._lookup_order(*key):
            index = bisect.bisect_right(effectives, ts) - 1
            if index + 1 < len(effectives):
                end = min(end, effectives[index + 1])  # this entry changes there
            if index >= 0:
                start = max(start, effectives[index])
                if found is None:
                    found = prices[index]
        if found is None:
            if self.default is None:
                raise NoPrice(f"no price for model {model!r} adapter {adapter!r} at {ts}")
            found = self.default
        if len(self._segments) > 10_000:
            self._segments.clear()
        # Between these times no candidate entry changes, so the answer cannot change either.
        self._segments[key] = (start, end, found)
        return found

    def line_costs(self, model: str, adapter: str | None, ts: float, input_tokens: int, output_tokens: int,
                   cached_tokens: int = 0, batch: bool = False) -> LineCosts:
        return self.price_at(model, adapter, ts).line_costs(input_tokens, output_tokens, cached_tokens, batch)

    def with_version(self, version: PriceVersion) -> PriceBook:
        return PriceBook([*self.versions, version], self.default)


def effective_versions(book: PriceBook, at: float) -> list[PriceVersion]:
    """The versions in force at `at`, one per (model, adapter) (for listings)."""
    current: dict[tuple[str, str], PriceVersion] = {}
    for version in book.versions:  # sorted by key, then effective
        if version.effective <= at:
            current[version.key] = version
    return list(current.values())


def parse_versions(entries: Iterable[dict[str, Any]]) -> list[PriceVersion]:
    return [PriceVersion.from_dict(entry) for entry in entries]
