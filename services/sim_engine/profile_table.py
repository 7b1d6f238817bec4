"""Engine timing as a profile table: the format NVIDIA Dynamo's mocker reads, built from our model.

Dynamo's mocker (`python -m dynamo.mocker --planner-profile-data FILE.npz`) prices an engine
iteration from two tables instead of its built-in polynomial:

- `prefill_isl` → `prefill_ttft_ms`: milliseconds to prefill that many new (uncached) tokens in
  one iteration, linear interpolation (extrapolated beyond the ends);
- `decode_active_kv_tokens` × `decode_context_length` → `decode_itl` (ms): one decode iteration
  over that many KV tokens of the running batch at that mean context length, bilinear
  (extrapolated).

An iteration that prefills and decodes costs the prefill time plus the decode time.
`build_table` writes such a table from our roofline (`inferbus.timing.RooflineModel`): a prefill of n
fresh tokens costs the roofline's step with n prefill tokens attending on average n/2 positions;
a decode over S KV tokens at mean context c costs the roofline's step with batch S/c over S
resident tokens. `TableStepModel` reads the same table back with the same interpolation and the
same composition, so our engine (`--profile-table`) and the mocker run from one engine timing.

What the table cannot say, for both engines alike: a prefill chunk's attention to context
already computed (a cached prefix or earlier chunks) is priced as if the chunk were a fresh
prompt, and a step's prefill and decode do not share one weight read.

Pure apart from `save_npz` / `load_npz`.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from inferbus.timing import RooflineModel

# Array names the mocker expects in the .npz file.
PREFILL_X = "prefill_isl"
PREFILL_Y = "prefill_ttft_ms"
DECODE_X = "decode_active_kv_tokens"
DECODE_Y = "decode_context_length"
DECODE_Z = "decode_itl"


@dataclass(frozen=True)
class ProfileTable:
    prefill_tokens: tuple[float, ...]
    prefill_ms: tuple[float, ...]
    decode_kv_tokens: tuple[float, ...]
    decode_context: tuple[float, ...]
    decode_ms: tuple[tuple[float, ...], ...]  # [kv index][context index]

    def __post_init__(self) -> None:
        if len(self.prefill_tokens) < 2 or len(self.prefill_tokens) != len(self.prefill_ms):
            raise ValueError("the prefill table needs at least two points and one time per point")
        if len(self.decode_kv_tokens) < 2 or len(self.decode_context) < 2:
            raise ValueError("the decode table needs at least two points on each axis")
        if len(self.decode_ms) != len(self.decode_kv_tokens) or any(
            len(row) != len(self.decode_context) for row in self.decode_ms
        ):
            raise ValueError("decode_itl must have one row per KV-token point and one column per context point")
        for name, axis in (("prefill_isl", self.prefill_tokens), ("decode_active_kv_tokens", self.decode_kv_tokens),
                           ("decode_context_length", self.decode_context)):
            if any(b <= a for a, b in zip(axis, axis[1:])):
                raise ValueError(f"{name} must be strictly increasing")

    def prefill_time_ms(self, new_tokens: float) -> float:
        """Milliseconds to prefill `new_tokens` in one iteration (0 for none)."""
        if new_tokens <= 0:
            return 0.0
        return max(0.0, _interp(self.prefill_tokens, self.prefill_ms, new_tokens))

    def decode_time_ms(self, kv_tokens: float, context: float) -> float:
        """Milliseconds of one decode iteration over `kv_tokens` at mean context `context`."""
        xs, ys = self.decode_kv_tokens, self.decode_context
        i, tx = _segment(xs, kv_tokens)
        j, ty = _segment(ys, context)
        z = self.decode_ms
        low = z[i][j] + (z[i][j + 1] - z[i][j]) * ty
        high = z[i + 1][j] + (z[i + 1][j + 1] - z[i + 1][j]) * ty
        return max(0.0, low + (high - low) * tx)


def _segment(axis: Sequence[float], x: float) -> tuple[int, float]:
    """Index of the segment holding x (the first or last one beyond the ends) and the fraction along it."""
    i = min(max(bisect_right(axis, x) - 1, 0), len(axis) - 2)
    return i, (x - axis[i]) / (axis[i + 1] - axis[i])


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    i, t = _segment(xs, x)
    return ys[i] + (ys[i + 1] - ys[i]) * t


def _geometric(lo: float, hi: float, points: int) -> list[float]:
    """`points` values from lo to hi, evenly spaced in log, rounded to whole tokens, distinct."""
    ratio = (hi / lo) ** (1 / (points - 1))
    values = sorted({round(lo * ratio**k) for k in range(points)})
    return [float(v) for v in values]


def build_table(
    model: RooflineModel,
    *,
    max_prefill_tokens: int = 32_768,
    max_kv_tokens: int | None = None,
    max_context: int = 131_072,
    points: int = 48,
) -> ProfileTable:
    """Sample the roofline into the mocker's table (see the module docstring for what each cell means)."""
    prefill = [1.0] + _geometric(16, max_prefill_tokens, points)
    prefill_ms = [model.step_time(0, 0, int(n), n / 2) * 1000 for n in prefill]
    kv_limit = max_kv_tokens or model.kv_capacity_tokens()
    kv = [1.0] + _geometric(16, max(kv_limit, 32), points)
    context = [1.0] + _geometric(16, max_context, points)
    decode = tuple(
        tuple(model.step_time(max(1, round(s / c)), int(s), 0, 0.0) * 1000 for c in context) for s in kv
    )
    return ProfileTable(tuple(prefill), tuple(prefill_ms), tuple(kv), tuple(context), decode)


@dataclass(frozen=True)
class TableStepModel:
    """A `StepTimeModel` read from a profile table, composed as Dynamo's mocker composes it. The
    table has no LoRA dimension: adapters in a step add nothing to its time."""

    table: ProfileTable

    @property
    def tokens_per_step(self) -> float:
        return 1.0  # a measured table prices plain decoding: one token per sequence per step

    def step_time(
        self,
        batch_decode: int,
        resident_ctx_tokens: int,
        prefill_tokens: int = 0,
        prefill_mean_ctx: float = 0.0,
        lora_adapters: float = 0.0,
    ) -> float:
        seconds = self.table.prefill_time_ms(prefill_tokens) / 1000
        if batch_decode > 0:
            seconds += self.table.decode_time_ms(resident_ctx_tokens, resident_ctx_tokens / batch_decode) / 1000
        return seconds


def save_npz(table: ProfileTable, path: str | Path) -> None:
    import numpy as np

    np.savez(
        path,
        **{  # type: ignore[arg-type]  # numpy's stub takes the arrays for savez's keyword flags
            PREFILL_X: np.array(table.prefill_tokens, dtype=np.float64),
            PREFILL_Y: np.array(table.prefill_ms, dtype=np.float64),
            DECODE_X: np.array(table.decode_kv_tokens, dtype=np.float64),
            DECODE_Y: np.array(table.decode_context, dtype=np.float64),
            DECODE_Z: np.array(table.decode_ms, dtype=np.float64),
        },
    )


def load_npz(path: str | Path) -> ProfileTable:
    """Read a mocker profile table; raises ValueError for a file that is not one."""
    import numpy as np

    try:
        with np.load(path) as data:
            arrays = {name: data[name] for name in (PREFILL_X, PREFILL_Y, DECODE_X, DECODE_Y, DECODE_Z)}
    except KeyError as exc:
        raise ValueError(f"{path}: not a profile table, missing array {exc}") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read a profile table: {exc}") from None
    values = [float(v) for name in arrays for v in arrays[name].ravel()]
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{path}: the profile table has non-finite values")
    decode = arrays[DECODE_Z]
    if decode.ndim != 2:
        raise ValueError(f"{path}: {DECODE_Z} must be two-dimensional")
    return ProfileTable(
        tuple(float(v) for v in arrays[PREFILL_X]),
        tuple(float(v) for v in arrays[PREFILL_Y]),
        tuple(float(v) for v in arrays[DECODE_X]),
        tuple(float(v) for v in arrays[DECODE_Y]),
        tuple(tuple(float(v) for v in row) for row in decode),
    )
