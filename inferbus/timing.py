"""GPU step-time model of a 70B-class transformer (roofline, fitted to published measurements).

One engine iteration runs B decode sequences over S resident context tokens plus n_p chunked
prefill tokens whose mean attended context is ctx_p (see docs/sim-engine.md
for the published numbers the constants reproduce and their sources):

    t_w   = W / (tp · BW · η_w)                        weights streamed once per step
    t_mm  = 2 · P · (B + n_p) / (tp · F_fp8 · η_mm)    GEMM compute
    t_kv  = S · kv_bytes / (tp · BW · η_kv)            attention reads of the KV cache
    t_att = 2 · L · d · n_p · ctx_p / (tp · F_bf16 · 0.5)   prefill attention
    t     = T0(tp) + max(t_w, t_mm) + γ · min(t_w, t_mm) + t_kv + t_att + c_seq · B

Engine options change the terms (each with its assumption and public source at its constant):

- precision: BF16 weights are 2 bytes per parameter and run their GEMMs at the BF16 rate; a BF16
  KV cache is 2 bytes per element (t_w, t_mm, t_kv and the KV capacity follow);
- speculative decoding (k draft tokens, per-token acceptance α): one iteration runs k draft steps
  and a verify step whose GEMMs carry B · (k + 1) tokens, and yields
  E = (1 − α^(k+1)) / (1 − α) tokens per sequence (`tokens_per_step`);
- LoRA: each step with adapters in the batch pays the batched LoRA kernels' launches and streams
  every distinct adapter's weights once.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
# Llama-3.x-70B's MLP width (the model card's intermediate_size), for LoRA adapter sizes.
LLAMA_70B_FFN = 28672

# Bytes per weight or KV element. FP8 (E4M3) is SGLang's `--quantization fp8` and
# `--kv-cache-dtype fp8_e4m3`; BF16 is the checkpoint's own precision.
PRECISIONS: dict[str, float] = {"fp8": 1.0, "bf16": 2.0}


@dataclass(frozen=True)
class SpecDecoding:
    """Speculative decoding: `draft_tokens` (k) proposed per iteration, each accepted with `acceptance` (α).

    Expected tokens per sequence per iteration, i.i.d. acceptance (Leviathan, Kalman and Matias,
    "Fast Inference from Transformers via Speculative Decoding", ICML 2023, eq. 1):
    E = (1 − α^(k+1)) / (1 − α). The verify step is one target forward over B · (k + 1) tokens
    (weights streamed once, GEMMs k + 1 times as wide). Each draft step costs `draft_cost` times a
    plain decode step at the same batch: an EAGLE-style draft head is one decoder layer plus the
    LM head (of 80 layers; Li et al., "EAGLE", ICML 2024), whose launches and KV reads make it
    about a tenth of a target step (assumption, ±50%).
    """

    draft_tokens: int
    acceptance: float
    draft_cost: float = 0.1

    def __post_init__(self) -> None:
        if self.draft_tokens < 1:
            raise ValueError("speculative decoding needs at least one draft token")
        if not 0 <= self.acceptance < 1:
            raise ValueError("the acceptance rate must be in [0, 1)")
        if self.draft_cost < 0:
            raise ValueError("the draft step's cost must not be negative")

    @property
    def tokens_per_step(self) -> float:
        k, a = self.draft_tokens, self.acceptance
        return (1 - a ** (k + 1)) / (1 - a)


# LoRA serving (S-LoRA, Sheng et al. 2023; Punica, Chen et al. 2023; SGLang `--enable-lora`):
# adapters on all seven projections of every layer. SGLang wraps the fused layers, so a layer runs
# four LoRA modules (qkv_proj, o_proj, gate_up_proj, down_proj; `sglang/srt/lora/layers.py`), each a
# shrink and an expand kernel per step (`lora/backend/chunked_backend.py`), about 1 µs each under
# CUDA graphs (assumption); every distinct adapter in the batch streams its A and B matrices from
# HBM once per step; adapters are BF16.
LORA_MODULES_PER_LAYER = 4
LORA_KERNEL_S = 1e-6
LORA_BYTES_PER_ELEMENT = 2.0
# The planner's load of an adapter onto the GPU: PCIe Gen5 x16 at ~25 GB/s achieved (assumption),
# plus a fixed 50 ms for reading the file and registering it with the engine. (The simulated engine
# prices the disk read and the copy into a GPU slot separately: services/sim_engine/lora_pool.py.)
LORA_LOAD_BANDWIDTH = 25 * GB
LORA_LOAD_FIXED_S = 0.05


def lora_adapter_bytes(rank: int, model: ModelSpec = LLAMA_70B, ffn: int = LLAMA_70B_FFN) -> float:
    """Bytes of one adapter of `rank` on q, k, v, o, gate, up, down: rank × (d_in + d_out) per projection."""
    d, kv = model.d_model, model.kv_heads * model.head_dim
    per_layer = (d + d) + 2 * (d + kv) + (d + d) + 2 * (d + ffn) + (ffn + d)
    return rank * per_layer * model.layers * LORA_BYTES_PER_ELEMENT


def lora_load_s(rank: int) -> float:
    """Seconds to load one adapter onto the GPU."""
    return LORA_LOAD_FIXED_S + lora_adapter_bytes(rank) / LORA_LOAD_BANDWIDTH


@dataclass(frozen=True)
class KvLink:
    """The link a prefill replica sends a prompt's KV to its decode replica over (prefill/decode
    disaggregation), per GPU and one way. Every GPU holds its share of the KV heads and sends or
    receives it on its own link, so the side with fewer GPUs sets the pace (the planner's
    arithmetic, docs/planning.md)."""

    name: str
    bandwidth: float  # bytes/s per GPU, one way

    def transfer_s(self, tokens: float, tp_prefill: int, tp_decode: int, model: ModelSpec = LLAMA_70B) -> float:
        """Seconds to move the KV of `tokens` tokens."""
        if tokens <= 0:
            return 0.0
        return tokens * model.kv_bytes_per_token / (min(tp_prefill, tp_decode) * self.bandwidth)


# NVLink 4 inside an H100/H200 SXM node: 900 GB/s per GPU both ways, 450 GB/s one way (NVIDIA
# datasheets). RDMA between nodes: one 400 Gb/s ConnectX-7 port per GPU, 50 GB/s one way (NVIDIA
# DGX H100 datasheet). Line rates.
KV_LINKS: dict[str, KvLink] = {
    "nvlink": KvLink("nvlink", 450 * GB),
    "rdma": KvLink("rdma", 50 * GB),
}


def kv_link(name: str, bandwidth_gb_s: float | None = None) -> KvLink:
    """A named link, its bandwidth per GPU optionally replaced (GB/s)."""
    try:
        link = KV_LINKS[name]
    except KeyError:
        raise ValueError(f"unknown KV link {name!r}; known: {sorted(KV_LINKS)}") from None
    if bandwidth_gb_s is not None:
        if bandwidth_gb_s <= 0:
            raise ValueError("the KV link's bandwidth must be positive")
        link = replace(link, bandwidth=bandwidth_gb_s * GB)
    return link


def expected_distinct_adapters(batch: float, adapters: int, slots: int) -> float:
    """Distinct adapters among `batch` sequences spread evenly over `adapters`, at most `slots`.

    The chance a given adapter is absent from the batch is (1 − 1/N)^B, so E[distinct] =
    N · (1 − (1 − 1/N)^B); the engine holds at most `slots` of them in one batch.
    """
    if adapters <= 0 or batch <= 0:
        return 0.0
    return min(float(slots), adapters * (1 - (1 - 1 / adapters) ** batch))


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

    @property
    def tokens_per_step(self) -> float:
        """Tokens each decoding sequence gains per step (1 without speculative decoding)."""
        ...

    def step_time(
        self,
        batch_decode: int,
        resident_ctx_tokens: int,
        prefill_tokens: int = 0,
        prefill_mean_ctx: float = 0.0,
        lora_adapters: float = 0.0,
    ) -> float: ...


@dataclass(frozen=True)
class RooflineModel:
    gpu: GpuSpec
    tp: int
    preset: Preset = PRESETS["latency"]
    model: ModelSpec = LLAMA_70B
    spec: SpecDecoding | None = None
    lora_rank: int = 0  # 0: LoRA off
    lora_slots: int = 0  # adapters held on the GPU (SGLang --max-loras-per-batch): their memory leaves the KV cache

    def __post_init__(self) -> None:
        if self.tp not in ALL_REDUCE_S:
            raise ValueError(f"tp must be one of {sorted(ALL_REDUCE_S)}, got {self.tp}")
        if self.lora_rank < 0 or self.lora_slots < 0:
            raise ValueError("LoRA rank and slots must not be negative")

    @property
    def base_step_s(self) -> float:
        return BASE_STEP_S + ALL_REDUCES_PER_STEP * ALL_REDUCE_S[self.tp]

    @property
    def gemm_flops(self) -> float:
        """FP8 weights run their GEMMs at the FP8 tensor-core rate, BF16 ones at the BF16 rate."""
        return self.gpu.fp8_flops if self.model.weight_bytes_per_param <= 1.0 else self.gpu.bf16_flops

    @property
    def tokens_per_step(self) -> float:
        return self.spec.tokens_per_step if self.spec else 1.0

    def _forward(self, tokens: float, batch_decode: float, resident: float, prefill: float, ctx: float) -> float:
        """One target-model forward: `tokens` through the GEMMs, `batch_decode` sequences' overheads."""
        tp, gpu, model = self.tp, self.gpu, self.model
        t_weights = model.weight_bytes / (tp * gpu.hbm_bandwidth * ETA_WEIGHTS)
        t_gemm = 2 * model.params * tokens / (tp * self.gemm_flops * ETA_GEMM)
        t_kv = resident * model.kv_bytes_per_token / (tp * gpu.hbm_bandwidth * ETA_KV)
        t_attention = (
            2 * model.layers * model.d_model * prefill * ctx
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

    def lora_step_s(self, tokens: float, adapters: float) -> float:
        """Batched LoRA's extra time in a step with `adapters` distinct adapters over `tokens` tokens."""
        if adapters <= 0 or self.lora_rank <= 0:
            return 0.0
        tp, gpu = self.tp, self.gpu
        adapter_bytes = lora_adapter_bytes(self.lora_rank, self.model)
        launches = self.model.layers * LORA_MODULES_PER_LAYER * 2 * LORA_KERNEL_S
        reads = adapters * adapter_bytes / (tp * gpu.hbm_bandwidth * ETA_WEIGHTS)
        # Every token multiplies by its adapter's A and B: 2 FLOPs per adapter element.
        gemm = 2 * tokens * adapter_bytes / LORA_BYTES_PER_ELEMENT / (tp * gpu.bf16_flops * ETA_GEMM)
        return launches + reads + gemm

    def step_time(
        self,
        batch_decode: int,
        resident_ctx_tokens: int,
        prefill_tokens: int = 0,
        prefill_mean_ctx: float = 0.0,
        lora_adapters: float = 0.0,
    ) -> float:
        """Seconds for one iteration; see the module docstring for the formula."""
        spec = self.spec
        verify_tokens = batch_decode * (spec.draft_tokens + 1 if spec else 1)
        tokens = verify_tokens + prefill_tokens
        step = self._forward(tokens, batch_decode, resident_ctx_tokens, prefill_tokens, prefill_mean_ctx)
        step += self.lora_step_s(tokens, lora_adapters)
        if spec is not None and batch_decode > 0:
            step += spec.draft_tokens * spec.draft_cost * self._forward(
                batch_decode, batch_decode, resident_ctx_tokens, 0, 0.0
            )
        return step

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache that fit next to the weights: about 419k on H100 TP2, 1.10M on H200 TP2."""
        free = self.tp * self.gpu.hbm_bytes * HBM_USABLE_FRACTION
        free -= self.model.weight_bytes + RESERVED_BYTES_PER_GPU * self.tp
        if self.lora_rank > 0:
            free -= self.lora_slots * lora_adapter_bytes(self.lora_rank, self.model)
        return max(0, int(free // self.model.kv_bytes_per_token))


@dataclass(frozen=True)
class FixedStepModel:
    """A constant time per iteration, whatever the batch (platform load tests)."""

    step_s: float
    tokens_per_step: float = 1.0

    def step_time(
        self,
        batch_decode: int,
        resident_ctx_tokens: int,
        prefill_tokens: int = 0,
        prefill_mean_ctx: float = 0.0,
        lora_adapters: float = 0.0,
    ) -> float:
        return self.step_s


def roofline(
    gpu: str = "H100",
    tp: int = 2,
    preset: str = "latency",
    *,
    weights: str = "fp8",
    kv_cache: str = "fp8",
    spec: SpecDecoding | None = None,
    lora_rank: int = 0,
    lora_slots: int = 0,
) -> RooflineModel:
    try:
        gpu_spec = GPUS[gpu]
    except KeyError:
        raise ValueError(f"unknown gpu {gpu!r}; known: {sorted(GPUS)}") from None
    try:
        preset_spec = PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}") from None
    for what, dtype in (("weights", weights), ("KV cache", kv_cache)):
        if dtype not in PRECISIONS:
            raise ValueError(f"unknown {what} precision {dtype!r}; known: {sorted(PRECISIONS)}")
    model = replace(LLAMA_70B, weight_bytes_per_param=PRECISIONS[weights], kv_bytes_per_element=PRECISIONS[kv_cache])
    return RooflineModel(gpu=gpu_spec, tp=tp, preset=preset_spec, model=model, spec=spec,
                         lora_rank=lora_rank, lora_slots=lora_slots)
