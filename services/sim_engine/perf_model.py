"""GPU step-time model of a 70B-class transformer (roofline, fitted to published measurements).

One engine iteration runs B decode sequences over S resident context tokens plus n_p chunked
prefill tokens whose mean attended context is ctx_p (see docs/sim-engine.md and
PERF_MODEL.md for the published numbers the constants reproduce):

    t_w   = W / (tp · BW · η_w)                        weights streamed once per step
    t_mm  = 2 · P · (B + n_p) / (tp · F_fp8 · η_mm)    GEMM compute
    t_kv  = S · kv_bytes / (tp · BW · η_kv)            attention reads of the KV cache
    t_att = 2 · L · d · n_p · ctx_p / (tp · F_bf16 · 0.5)   prefill attention
    t     = T0(tp) + max(t_w, t_mm) + γ · min(t_w, t_mm) + t_kv + t_att + c_seq · B

Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class GpuSpec:
    name: str
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    fp8_flops: float  # dense FLOP/s
    bf16_flops: float


# NVIDIA datasheets: H100 SXM 80 GB at 3.35 TB/s, H200 141 GB at 4.8 TB/s; both 1,979 TFLOP/s
# FP8 and 989 TFLOP/s BF16 dense.
GPUS: dict[str, GpuSpec] = {
    "H100": GpuSpec("H100", 80 * GB, 3.35 * TB, 1979 * TB, 989 * TB),
    "H200": GpuSpec("H200", 141 * GB, 4.8 * TB, 1979 * TB, 989 * TB),
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    layers: int
    d_model: int
    kv_heads: int
    head_dim: int
    weight_bytes_per_param: float = 1.0  # FP8 weights
    kv_bytes_per_element: float = 1.0  # FP8 KV cache

    @property
    def weight_bytes(self) -> float:
        return self.params * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        # K and V, every layer, every KV head.
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_element


# Llama-3.x-70B (FP8): 70.6 GB of weights, 163,840 B of KV per token.
LLAMA_70B = ModelSpec("Llama-3.x-70B", 70.6e9, layers=80, d_model=8192, kv_heads=8, head_dim=128)


@dataclass(frozen=True)
class Preset:
    """Per-sequence overhead and how much of the smaller of weight streaming and GEMM time fails to overlap."""

    c_seq_s: float
    gamma: float


PRESETS: dict[str, Preset] = {
    # Online serving (batch ≲ 128): reproduces NIM's ITL at concurrency 1–50 within ±10%.
    "latency": Preset(c_seq_s=0.05e-3, gamma=0.25),
    # Offline upper bound: within ~6% of TensorRT-LLM's max-throughput tables.
    "throughput": Preset(c_seq_s=0.0, gamma=0.0),
}

# Fitted efficiencies (fractions of peak bandwidth / compute actually achieved).
ETA_WEIGHTS = 0.75
ETA_KV = 0.50
ETA_GEMM = 0.50
PREFILL_ATTENTION_EFFICIENCY = 0.5
# Fixed per-step cost: kernel launches and scheduling, plus 160 all-reduces (2 per layer) whose
# latency grows with the TP group.
BASE_STEP_S = 1.5e-3
ALL_REDUCES_PER_STEP = 160
ALL_REDUCE_S: dict[int, float] = {1: 0.0, 2: 18e-6, 4: 22e-6, 8: 28e-6}
# KV capacity: usable fraction of HBM and the per-GPU reserve for activations and CUDA graphs.
HBM_USABLE_FRACTION = 0.92
RESERVED_BYTES_PER_GPU = 4 * GB


class StepTimeModel(Protocol):
    """Anything that prices one engine iteration; a measured sweep table can replace the roofline."""

    def step_time(
        self,
        batch_decode: int,
        resident_ctx_tokens: int,
        prefill_tokens: int = 0,
        prefill_mean_ctx: float = 0.0,
    ) -> float: ...


@dataclass(frozen=True)
class RooflineModel:
    gpu: GpuSpec
    tp: int
    preset: Preset = PRESETS["latency"]
    model: ModelSpec = LLAMA_70B

    def __post_init__(self) -> None:
        if self.tp not in ALL_REDUCE_S:
            raise ValueError(f"tp must be one of {sorted(ALL_REDUCE_S)}, got {self.tp}")

    @property
    def base_step_s(self) -> float:
        return BASE_STEP_S + ALL_REDUCES_PER_STEP * ALL_REDUCE_S[self.tp]

    def step_time(
        self,
        batch_decode: int,
        resident_ctx_tokens: int,
        prefill_tokens: int = 0,
        prefill_mean_ctx: float = 0.0,
    ) -> float:
        """Seconds for one iteration; see the module docstring for the formula."""
        tp, gpu, model = self.tp, self.gpu, self.model
        t_weights = model.weight_bytes / (tp * gpu.hbm_bandwidth * ETA_WEIGHTS)
        t_gemm = 2 * model.params * (batch_decode + prefill_tokens) / (tp * gpu.fp8_flops * ETA_GEMM)
        t_kv = resident_ctx_tokens * model.kv_bytes_per_token / (tp * gpu.hbm_bandwidth * ETA_KV)
        t_attention = (
            2 * model.layers * model.d_model * prefill_tokens * prefill_mean_ctx
            / (tp * gpu.bf16_flops * PREFILL_ATTENTION_EFFICIENCY)
        )
        return (
            self.base_step_s
            + max(t_weights, t_gemm)
            + self.preset.gamma * min(t_weights, t_gemm)
            + t_kv
            + t_attention
            + self.preset.c_seq_s * batch_decode
        )

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache that fit next to the weights: about 419k on H100 TP2, 1.10M on H200 TP2."""
        free = self.tp * self.gpu.hbm_bytes * HBM_USABLE_FRACTION
        free -= self.model.weight_bytes + RESERVED_BYTES_PER_GPU * self.tp
        return max(0, int(free // self.model.kv_bytes_per_token))


@dataclass(frozen=True)
class FixedStepModel:
    """A constant time per iteration, whatever the batch (platform load tests)."""

    step_s: float

    def step_time(
        self,
        batch_decode: int,
        resident_ctx_tokens: int,
        prefill_tokens: int = 0,
        prefill_mean_ctx: float = 0.0,
    ) -> float:
        return self.step_s


def roofline(gpu: str = "H100", tp: int = 2, preset: str = "latency") -> RooflineModel:
    try:
        gpu_spec = GPUS[gpu]
    except KeyError:
        raise ValueError(f"unknown gpu {gpu!r}; known: {sorted(GPUS)}") from None
    try:
        preset_spec = PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}") from None
    return RooflineModel(gpu=gpu_spec, tp=tp, preset=preset_spec)
