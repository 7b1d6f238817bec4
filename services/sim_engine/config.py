"""Settings of the simulated engine: one object, shared by the pure core and the HTTP shell."""

from __future__ import annotations

from dataclasses import dataclass

from inferbus.timing import roofline
from inferbus.tokens.blocks import DEFAULT_BLOCK_SIZE

DEFAULT_MODEL = "meta-llama/Llama-3.3-70B-Instruct"
GPU_NAMES = ("H100", "H200")
QUANTIZATIONS = ("fp8", "none")  # SGLang --quantization; none: the checkpoint's BF16 weights
KV_CACHE_DTYPES = ("fp8_e4m3", "auto")  # SGLang --kv-cache-dtype; auto: BF16
TP_SIZES = (1, 2, 4, 8)
PRESET_NAMES = ("latency", "throughput")
PRICED_LORA_RANK = 16  # the LoRA rank the timing model prices when no --max-lora-rank caps it
# SGLang 0.5.23's --disaggregation-mode and --disaggregation-transfer-backend choices.
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp")


# Free-text answers' lengths, log-normal: median 180 tokens and a spread (sigma 0.9 of the
# logarithm) that puts one answer in ten under 57 tokens and one in ten over 570, a chat model's
# mix of short replies and long explanations.
DEFAULT_ANSWER_LENGTH_MEDIAN = 180
ANSWER_LENGTH_SIGMA = 0.9


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
    # SGLang's --max-loaded-loras (adapters in host memory; None: no limit) and
    # --lora-eviction-policy (which GPU slot a batch takes when all are full): lora_pool.py.
    max_loaded_loras: int | None = None
    lora_eviction_policy: str = "lru"
    # SGLang's --enable-lora-overlap-loading: copies into GPU adapter slots run beside the steps
    # instead of blocking them, and a request joins the batch once its adapter's copy is done.
    lora_overlap_loading: bool = False
    # Seconds every adapter load takes, GPU slot copies then free (tests); None: from the
    # adapter's size and where it comes from (lora_pool.py).
    lora_load_time_s: float | None = None
    # SGLang's --max-lora-rank: a local adapter directory of higher rank is refused at load, and
    # the timing model prices each distinct adapter's batched kernels at this rank (at
    # PRICED_LORA_RANK when unset, since then any rank loads).
    max_lora_rank: int | None = None
    # Accept any adapter path at load time and fail on first use, as engines that load lazily do
    # (the worker must verify loads rather than trust a 200).
    lazy_lora_loading: bool = False
    # Wall seconds per simulated second: 1.0 is real time, 0 runs steps back to back.
    time_scale: float = 1.0
    # A constant step time in ms instead of the roofline model (load tests of the platform).
    fixed_step_ms: float | None = None
    # Step times from a profile table (.npz, the format of NVIDIA Dynamo's mocker
    # --planner-profile-data; see profile_table.py) instead of the roofline model.
    profile_table: str | None = None
    # Decode and prefill in one step (SGLang's --enable-mixed-chunk). Off, as SGLang's default
    # and Dynamo's mocker in SGLang mode: a step that can prefill does only that, and decoding
    # requests wait for the next prefill-free step.
    mixed_chunk: bool = True
    # Overrides the KV capacity derived from GPU memory.
    kv_capacity_tokens: int | None = None
    # SGLang's --enable-priority-scheduling: waiting requests are admitted by priority (larger
    # first) and a waiting one retracts a running one whose priority is lower by more than the
    # threshold. On by default here, as inferbus runs its engines; off, priority is ignored
    # (first come, first served) and workers must abort batch lines themselves.
    priority_scheduling: bool = True
    priority_preemption_threshold: int = 10
    context_length: int = 131_072
    # Whether --context-length was given: SGLang reports the flag in /server_info (null when unset)
    # and the window it enforces through max_req_input_len.
    context_length_set: bool = False
    # SGLang's --kv-events-config JSON, e.g. {"publisher": "zmq", "endpoint": "tcp://*:5557"}.
    kv_events_config: str | None = None
    # Engine options the timing model prices (docs/sim-engine.md): weight and KV precision,
    # speculative decoding (SGLang --speculative-num-steps draft tokens per step; the acceptance
    # rate and a draft step's cost relative to a decode step are the draft model's, simulated),
    # (the LoRA rank each step pays for is `max_lora_rank` above).
    quantization: str = "fp8"
    kv_cache_dtype: str = "fp8_e4m3"
    speculative_num_steps: int = 0
    speculative_acceptance: float = 0.7
    speculative_draft_cost: float = 0.1
    # The model family's tool-call format, as SGLang's --tool-call-parser names it: `llama3`
    # (JSON `{"name", "parameters"}`), `hermes`/`qwen25`/`qwen` (`<tool_call>...</tool_call>`), `mistral`,
    # `pythonic`, `deepseekv3`/`deepseekv31` or `gpt-oss` (constrained.FAMILIES).
    tool_call_parser: str = "llama3"
    # Free text ends with EOS after a length drawn per request from a log-normal distribution with
    # this median (tokens), seeded by the context (and the sampling seed); 0: it ends only at
    # max_new_tokens or a stop, as every request with ignore_eos does.
    answer_length_median: int = DEFAULT_ANSWER_LENGTH_MEDIAN
    # Chance of answering an arithmetic question right (quality.py); None: the model directory's
    # inferbus_sim.json, else 0.95.
    eval_accuracy: float | None = None
    # Prefill/decode disaggregation (SGLang's PD mode; docs/sim-engine.md): the role, the prefill's
    # bootstrap server port, the transfer backend's name (only `fake` changes anything here), the
    # decode role's prefix cache (off unless asked, as SGLang), the decode tokens reserved per
    # running request when admitting a transfer, and the KV link the prefill sends over.
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_decode_enable_radix_cache: bool = False
    disaggregation_ib_device: str | None = None
    disaggregation_decode_retraction_backup: str | None = None  # reported; a decode engine always restores
    num_reserved_decode_tokens: int = 512
    kv_transfer_link: str = "rdma"
    kv_transfer_bandwidth_gb_s: float | None = None
    # SGLang's --disable-radix-cache: no prefix cache (nothing matched, nothing published).
    disable_radix_cache: bool = False
    host: str = "127.0.0.1"
    port: int = 30000

    @property
    def priced_lora_rank(self) -> int:
        return self.max_lora_rank or PRICED_LORA_RANK

    @property
    def prefix_cache(self) -> bool:
        """Whether the radix cache runs: SGLang turns it off on a decode engine unless
        --disaggregation-decode-enable-radix-cache."""
        if self.disaggregation_mode == "decode" and not self.disaggregation_decode_enable_radix_cache:
            return False
        return not self.disable_radix_cache

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
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError("max_loaded_loras should be greater than or equal to max_loras_per_batch "
                             f"(max_loaded_loras={self.max_loaded_loras}, "
                             f"max_loras_per_batch={self.max_loras_per_batch})")
        if self.lora_eviction_policy not in ("lru", "fifo"):
            raise ValueError(f"lora_eviction_policy must be lru or fifo, got {self.lora_eviction_policy!r}")
        if self.lora_load_time_s is not None and self.lora_load_time_s < 0:
            raise ValueError("lora_load_time_s must not be negative")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError("max_lora_rank must be at least 1")
        if self.time_scale < 0:
            raise ValueError("time_scale must not be negative")
        if self.fixed_step_ms is not None and self.fixed_step_ms < 0:
            raise ValueError("fixed_step_ms must not be negative")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.speculative_num_steps < 0:
            raise ValueError("speculative_num_steps must not be negative")
        if not 0 <= self.speculative_acceptance < 1:
            raise ValueError("speculative_acceptance must be in [0, 1)")
        if self.answer_length_median < 0:
            raise ValueError("answer_length_median must be at least 0")
        if self.eval_accuracy is not None and not 0 <= self.eval_accuracy <= 1:
            raise ValueError("eval_accuracy must be in [0, 1]")
        if self.speculative_draft_cost < 0:
            raise ValueError("speculative_draft_cost must not be negative")
        if self.fixed_step_ms is not None and self.profile_table is not None:
            raise ValueError("give fixed_step_ms or profile_table, not both")
        from .constrained import FAMILIES

        if self.tool_call_parser not in FAMILIES:
            raise ValueError(f"tool_call_parser must be one of {FAMILIES}, got {self.tool_call_parser!r}")
        self._check_disaggregation()
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < self.block_size:
            raise ValueError("kv_capacity_tokens must hold at least one block")
        if self.kv_capacity_tokens is None and self.fixed_step_ms is None:
            weights = "fp8" if self.quantization == "fp8" else "bf16"
            kv_cache = "fp8" if self.kv_cache_dtype == "fp8_e4m3" else "bf16"
            if roofline(self.gpu, self.tp, weights=weights, kv_cache=kv_cache).kv_capacity_tokens() < self.block_size:
                hint = "more GPUs (--tp)" + (" or --quantization fp8" if weights == "bf16" else "")
                raise ValueError(
                    f"{weights.upper()} weights of a 70B model leave no KV cache on {self.tp} × {self.gpu}: use {hint}"
                )

    def _check_disaggregation(self) -> None:
        from inferbus.timing import kv_link

        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(
                f"disaggregation_mode must be one of {DISAGGREGATION_MODES}, got {self.disaggregation_mode!r}"
            )
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"disaggregation_transfer_backend must be one of {TRANSFER_BACKENDS}, "
                             f"got {self.disaggregation_transfer_backend!r}")
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            raise ValueError("disaggregation_bootstrap_port must be a TCP port")
        if self.num_reserved_decode_tokens < 0:
            raise ValueError("num_reserved_decode_tokens must not be negative")
        # SGLang's own checks (its arg_groups/pd_disaggregation_hook.py), with its words.
        if self.disaggregation_mode == "prefill" and self.disaggregation_transfer_backend == "fake":
            raise ValueError("Prefill server does not support 'fake' as the transfer backend")
        if (self.disaggregation_mode == "decode" and self.disaggregation_decode_enable_radix_cache
                and self.disaggregation_transfer_backend == "fake"):
            raise ValueError("--disaggregation-decode-enable-radix-cache is incompatible with "
                             "--disaggregation-transfer-backend fake")
        kv_link(self.kv_transfer_link, self.kv_transfer_bandwidth_gb_s)
