"""Settings of the simulated engine: one object, shared by the pure core and the HTTP shell."""

from __future__ import annotations

from dataclasses import dataclass

from inferbus.tokens import DEFAULT_BLOCK_SIZE

DEFAULT_MODEL = "meta-llama/Llama-3.3-70B-Instruct"
GPU_NAMES = ("H100", "H200")
TP_SIZES = (1, 2, 4, 8)
PRESET_NAMES = ("latency", "throughput")


@dataclass
class EngineConfig:
    gpu: str = "H100"
    tp: int = 2
    model: str = DEFAULT_MODEL
    preset: str = "latency"
    # Prefill tokens per step (SGLang --chunked-prefill-size). 512 is the calibrated default: it
    # reproduces NVIDIA's published H100 TP2 closed-loop points within 7% (docs/sim-engine.md).
    chunked_prefill_size: int = 512
    max_running_requests: int = 256
    # Whether --max-running-requests was given: SGLang reports the flag at the top of /server_info
    # (null when unset) and the effective value in internal_states.
    max_running_requests_set: bool = False
    # The served model's directory (tokenizer.json, chat template): prompts given as text are
    # tokenized with it and output ids are drawn from its vocabulary. None: the stand-in tokenizer.
    model_dir: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    max_loras_per_batch: int = 8
    lora_load_time_s: float = 0.2
    # SGLang's --max-lora-rank: a local adapter directory of higher rank is refused at load.
    max_lora_rank: int | None = None
    # Accept any adapter path at load time and fail on first use, as engines that load lazily do
    # (the worker must verify loads rather than trust a 200).
    lazy_lora_loading: bool = False
    # Wall seconds per simulated second: 1.0 is real time, 0 runs steps back to back.
    time_scale: float = 1.0
    # A constant step time in ms instead of the roofline model (load tests of the platform).
    fixed_step_ms: float | None = None
    # Overrides the KV capacity derived from GPU memory.
    kv_capacity_tokens: int | None = None
    # SGLang's --enable-priority-scheduling: waiting requests are admitted by priority (larger
    # first) and a waiting one retracts a running one whose priority is lower by more than the
    # threshold. On by default here, as inferbus runs its engines; off, priority is ignored
    # (first come, first served) and workers must abort batch lines themselves.
    priority_scheduling: bool = True
    priority_preemption_threshold: int = 10
    context_length: int = 131_072
    # SGLang's --kv-events-config JSON, e.g. {"publisher": "zmq", "endpoint": "tcp://*:5557"}.
    kv_events_config: str | None = None
    # The model family's tool-call format, as SGLang's --tool-call-parser names it: `llama3`
    # (JSON `{"name", "parameters"}`) or `hermes`/`qwen25`/`qwen` (`<tool_call>...</tool_call>`).
    tool_call_parser: str = "llama3"
    host: str = "127.0.0.1"
    port: int = 30000

    def __post_init__(self) -> None:
        if self.gpu not in GPU_NAMES:
            raise ValueError(f"gpu must be one of {GPU_NAMES}, got {self.gpu!r}")
        if self.tp not in TP_SIZES:
            raise ValueError(f"tp must be one of {TP_SIZES}, got {self.tp}")
        if self.preset not in PRESET_NAMES:
            raise ValueError(f"preset must be one of {PRESET_NAMES}, got {self.preset!r}")
        if self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be at least 1")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be at least 1")
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if self.max_loras_per_batch < 1:
            raise ValueError("max_loras_per_batch must be at least 1 (the base model takes one slot)")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError("max_lora_rank must be at least 1")
        if self.time_scale < 0:
            raise ValueError("time_scale must not be negative")
        if self.fixed_step_ms is not None and self.fixed_step_ms < 0:
            raise ValueError("fixed_step_ms must not be negative")
        from .constrained import FAMILIES

        if self.tool_call_parser not in FAMILIES:
            raise ValueError(f"tool_call_parser must be one of {FAMILIES}, got {self.tool_call_parser!r}")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < self.block_size:
            raise ValueError("kv_capacity_tokens must hold at least one block")
