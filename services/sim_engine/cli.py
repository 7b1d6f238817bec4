"""`inferbus sim-engine`: run the simulated GPU engine (SGLang's HTTP API) under uvicorn."""

from __future__ import annotations

import logging

import click

from inferbus.tokens.blocks import DEFAULT_BLOCK_SIZE

from .config import (
    DEFAULT_ANSWER_LENGTH_MEDIAN,
    DEFAULT_MODEL,
    DISAGGREGATION_MODES,
    GPU_NAMES,
    KV_CACHE_DTYPES,
    PRESET_NAMES,
    QUANTIZATIONS,
    TRANSFER_BACKENDS,
    EngineConfig,
)
from .profile_table import load_npz


@click.command("sim-engine")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", default=30000, show_default=True, type=int, help="Port to listen on (SGLang's default).")
@click.option(
    "--gpu", type=click.Choice(GPU_NAMES), default="H100", show_default=True,
    help="GPU whose memory bandwidth, compute and HBM size the timing model uses.",
)
@click.option(
    "--tp", type=click.Choice(["1", "2", "4", "8"]), default="2", show_default=True,
    help="Tensor-parallel degree: GPUs per replica (bandwidth and KV capacity scale with it).",
)
@click.option(
    "--model",
    default=DEFAULT_MODEL,
    show_default=True,
    help="Model name reported as model_path (timing is always a 70B-class model).",
)
@click.option(
    "--preset", type=click.Choice(PRESET_NAMES), default="latency", show_default=True,
    help="Timing constants: 'latency' fits online serving (NIM), 'throughput' the offline upper bound (TensorRT-LLM).",
)
@click.option(
    "--time-scale", default=1.0, show_default=True, type=float,
    help="Wall seconds per simulated second: 1 is real time, 0.1 runs ten times faster, 0 runs steps back to back.",
)
@click.option(
    "--fixed-step-ms", default=None, type=float,
    help="Use this constant step time (ms per decode step) instead of the GPU model; 0 is as fast as possible.",
)
@click.option(
    "--profile-table", default=None, type=click.Path(exists=True, dir_okay=False),
    help="Take step times from this profile table (.npz in the format of NVIDIA Dynamo's mocker "
         "--planner-profile-data, e.g. from `inferbus profile-table`) instead of the GPU model.",
)
@click.option(
    "--chunked-prefill-size",
    default=512,
    show_default=True,
    type=int,
    help="Prefill tokens per step (chunked prefill budget); 512 is calibrated against published H100 numbers.",
)
@click.option(
    "--max-running-requests",
    default=None,
    type=int,
    help="Most requests in the running batch (default 256; /server_info reports it at the top only when given, "
    "as SGLang does).",
)
@click.option("--context-length", default=None, type=click.IntRange(min=16),
              help="The context window (SGLang's flag): prompt plus output tokens. Default: the model directory's "
                   "config.json, as SGLang derives it, else 131072.")
@click.option(
    "--model-dir",
    default=None,
    envvar="INFERBUS_MODEL_DIR",
    show_envvar=True,
    type=click.Path(exists=True, file_okay=False),
    help="The served model's directory (tokenizer.json, tokenizer_config.json with the chat template): text is "
    "tokenized with it and output is token ids of its vocabulary. Without it, a stand-in tokenizer "
    "(capacity tools only).",
)
@click.option(
    "--block-size",
    default=DEFAULT_BLOCK_SIZE,
    show_default=True,
    type=int,
    help="Prefix-cache page size in tokens (SGLang's --page-size; 1 on CPU). Workers rebuild the cache events "
    "into the platform's blocks, so it need not match INFERBUS_BLOCK_SIZE.",
)
@click.option(
    "--max-loras-per-batch",
    default=8,
    show_default=True,
    type=int,
    help="Distinct adapters per batch; the base model counts as one.",
)
@click.option("--max-lora-rank", default=None, type=click.IntRange(min=1),
              help="Refuse to load a local adapter directory whose adapter_config.json rank is higher (SGLang's flag), "
                   "and price each distinct adapter's batched kernels and weight reads per step at this rank "
                   "(default: no limit, priced at rank 16).")
@click.option("--max-loaded-loras", default=None, type=click.IntRange(min=1),
              help="Most adapters in host memory (SGLang's flag; at least --max-loras-per-batch): a load beyond it "
                   "unloads the least recently used unpinned adapter. Default: no limit.")
@click.option("--lora-eviction-policy", default="lru", show_default=True, type=click.Choice(["lru", "fifo"]),
              help="Which GPU adapter slot a batch takes when all are full (SGLang's flag).")
@click.option("--enable-lora-overlap-loading", "lora_overlap_loading", is_flag=True,
              help="Copy adapters into GPU slots beside the running steps instead of blocking them; a request whose "
                   "adapter is being copied waits for it (SGLang's flag).")
@click.option("--lora-load-time", default=None, type=click.FloatRange(min=0),
              help="Simulated seconds every adapter load takes, GPU slot copies then free. Default: from the adapter's "
                   "size (rank × the modelled 70B's projections, BF16): disk at 2 GB/s + 0.1 s, host to GPU at 25 GB/s "
                   "+ 0.05 s.")
@click.option(
    "--kv-capacity-tokens",
    default=None,
    type=int,
    help="KV cache size in tokens (default: derived from GPU memory, ~419k on H100 TP2).",
)
@click.option(
    "--lazy-lora-loading",
    is_flag=True,
    help="Answer 200 to any adapter load and fail on first use (as lazily loading engines do).",
)
@click.option(
    "--mixed-chunk/--no-mixed-chunk", default=True, show_default=True,
    help="Decode and prefill in the same step (SGLang's --enable-mixed-chunk); off, a step that can "
         "prefill does only that (SGLang's default scheduling, and Dynamo's mocker in SGLang mode).",
)
@click.option(
    "--priority-scheduling/--no-priority-scheduling", default=True, show_default=True,
    help="Admit waiting requests by priority and let them retract lower-priority running ones "
         "(SGLang's --enable-priority-scheduling); off, priority is ignored.",
)
@click.option(
    "--kv-events-config", default=None,
    help='Publish prefix-cache events on ZMQ, as SGLang: \'{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"}\'.',
)
@click.option("--quantization", type=click.Choice(QUANTIZATIONS), default="fp8", show_default=True,
              help="Weight precision the timing model prices: fp8 (SGLang --quantization fp8) or none (BF16 weights: "
                   "twice the bytes, half the GEMM rate; a 70B model needs TP4 on H100).")
@click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="fp8_e4m3", show_default=True,
              help="KV cache precision: fp8_e4m3 or auto (BF16: twice the bytes per token, half the capacity).")
@click.option("--speculative-num-steps", default=0, show_default=True, type=click.IntRange(min=0),
              help="Speculative decoding: draft tokens per step (SGLang's option; 0 is off). The verify step's "
                   "GEMMs carry (k + 1) tokens per sequence; accepted drafts stream as extra tokens.")
@click.option("--speculative-acceptance", default=0.7, show_default=True, type=click.FloatRange(0, 1, max_open=True),
              help="Simulated: the chance the target accepts each draft token (a property of the draft model).")
@click.option("--speculative-draft-cost", default=0.1, show_default=True, type=click.FloatRange(min=0),
              help="Simulated: one draft step's time as a fraction of a decode step (EAGLE-style draft head).")
@click.option(
    "--tool-call-parser",
    type=click.Choice(
        ["llama3", "hermes", "qwen25", "qwen", "mistral", "pythonic", "deepseekv3", "deepseekv31", "gpt-oss"]
    ),
    default="llama3",
    show_default=True,
    help="How the simulated model writes tool calls (SGLang's flag of the same name): llama3 JSON, Hermes/Qwen "
    "<tool_call> blocks, Mistral [TOOL_CALLS] arrays, pythonic (Llama-4) call lists, DeepSeek call blocks "
    "or gpt-oss harmony messages to functions.",
)
@click.option("--answer-length-median", default=DEFAULT_ANSWER_LENGTH_MEDIAN, show_default=True,
              type=click.IntRange(min=0), envvar="INFERBUS_SIM_ANSWER_LENGTH_MEDIAN",
              help="Simulated: free text ends with EOS after a length drawn per request from a log-normal "
                   "distribution with this median (tokens), seeded by the prompt and sampling seed; 0: answers end "
                   "only at max_tokens or a stop, as every request with ignore_eos does (benchmarks).")
@click.option("--eval-accuracy", default=None, type=click.FloatRange(0, 1),
              help="Simulated quality: the chance of answering an arithmetic question ('What is 17 + 25?') right "
                   "(default: eval_accuracy of the model directory's inferbus_sim.json, else 0.95). Eval suites "
                   "and the canary's eval gate measure it.")
@click.option("--disaggregation-mode", type=click.Choice(DISAGGREGATION_MODES), default="null", show_default=True,
              help="Prefill/decode disaggregation (SGLang's PD mode): 'prefill' computes prompts and sends their KV, "
                   "'decode' receives it and generates; each request goes to both with bootstrap_host/port/room. "
                   "See docs/sim-engine.md.")
@click.option("--disaggregation-bootstrap-port", default=8998, show_default=True, type=click.IntRange(1, 65535),
              help="Prefill role: the port of its bootstrap server, which decode engines ask where to send the KV "
                   "(SGLang's flag; clients pass it as bootstrap_port).")
@click.option("--disaggregation-transfer-backend", type=click.Choice(TRANSFER_BACKENDS), default="mooncake",
              show_default=True,
              help="SGLang's KV transfer backend name. Only 'fake' changes the simulation: a decode engine then "
                   "needs no prefill (a prefill engine refuses it, as SGLang).")
@click.option(
    "--disaggregation-ib-device", default=None, help="Accepted for SGLang compatibility; nothing to select here."
)
@click.option(
    "--disaggregation-decode-retraction-backup",
    type=click.Choice(["cpu_tensor", "host_pool", "none"]),
    default=None,
    help="Accepted and reported for SGLang compatibility (where SGLang keeps a retracted decode request's KV); "
    "a simulated decode engine always restores it from host memory.",
)
@click.option("--disaggregation-decode-enable-radix-cache", is_flag=True,
              help="Decode role: keep a prefix cache (off by default, as SGLang), publish its events, and have the "
                   "prefill send only what it does not hold.")
@click.option("--num-reserved-decode-tokens", default=512, show_default=True, type=click.IntRange(min=0),
              help="Decode role: KV tokens held back per running or arriving request when reserving KV for a "
                   "transfer (SGLang's flag).")
@click.option("--kv-transfer-link", type=click.Choice(["rdma", "nvlink"]), default="rdma", show_default=True,
              help="Simulated: the link the prefill sends KV over, per GPU and one way: RDMA between nodes "
                   "(a 400 Gb/s port, 50 GB/s) or NVLink inside one (450 GB/s); the side with fewer GPUs sets the "
                   "pace.")
@click.option("--kv-transfer-bandwidth", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Simulated: the link's nominal GB/s per GPU, replacing the link's own.")
@click.option(
    "--disable-radix-cache", is_flag=True, help="No prefix cache: nothing is matched or published (SGLang's flag)."
)
@click.option(
    "--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True,
    help="Log level of the engine and uvicorn.",
)
@click.option("--fault-injection/--no-fault-injection", default=False, show_default=True,
              envvar="INFERBUS_SIM_FAULT_INJECTION", show_envvar=True,
              help="Serve POST /fault {\"mode\": \"hang\"|\"fail\"|\"none\"}: a hung GPU (steps stop, requests make no "
                   "progress) or a failing one (generations and health checks answer 500), for failure drills.")
@click.option("--fault", type=click.Choice(["none", "hang", "fail"]), default="none", show_default=True,
              help="With --fault-injection: the fault to start in.")
@click.option("--time-scale-control", is_flag=True,
              help="Serve POST /time_scale {\"time_scale\": S}: change the wall seconds per simulated second while "
                   "running (benchmarks speed up idle phases such as adapter prefetching; simulated durations "
                   "unchanged).")
def sim_engine_command(
    host: str,
    port: int,
    gpu: str,
    tp: str,
    model: str,
    preset: str,
    time_scale: float,
    fixed_step_ms: float | None,
    profile_table: str | None,
    chunked_prefill_size: int,
    max_running_requests: int | None,
    context_length: int | None,
    model_dir: str | None,
    block_size: int,
    max_loras_per_batch: int,
    max_lora_rank: int | None,
    max_loaded_loras: int | None,
    lora_eviction_policy: str,
    lora_overlap_loading: bool,
    lora_load_time: float | None,
    kv_capacity_tokens: int | None,
    lazy_lora_loading: bool,
    mixed_chunk: bool,
    priority_scheduling: bool,
    kv_events_config: str | None,
    quantization: str,
    kv_cache_dtype: str,
    speculative_num_steps: int,
    speculative_acceptance: float,
    speculative_draft_cost: float,
    tool_call_parser: str,
    eval_accuracy: float | None,
    answer_length_median: int,
    disaggregation_mode: str,
    disaggregation_bootstrap_port: int,
    disaggregation_transfer_backend: str,
    disaggregation_ib_device: str | None,
    disaggregation_decode_retraction_backup: str | None,
    disaggregation_decode_enable_radix_cache: bool,
    num_reserved_decode_tokens: int,
    kv_transfer_link: str,
    kv_transfer_bandwidth: float | None,
    disable_radix_cache: bool,
    log_level: str,
    fault_injection: bool,
    fault: str,
    time_scale_control: bool,
) -> None:
    """Serve SGLang 0.5.23's native HTTP API (/generate, /abort_request, LoRA, /v1/loads,
    /metrics, ...) from a simulated GPU: a roofline timing model of a 70B FP8 model with
    continuous batching, chunked prefill, a prefix cache, KV capacity and LoRA slots.
    For development, CI, load tests and capacity planning; see docs/sim-engine.md."""
    import uvicorn

    from .app import create_app

    try:
        config = EngineConfig(
            gpu=gpu,
            tp=int(tp),
            model=model,
            preset=preset,
            chunked_prefill_size=chunked_prefill_size,
            max_running_requests=256 if max_running_requests is None else max_running_requests,
            max_running_requests_set=max_running_requests is not None,
            context_length=EngineConfig.context_length if context_length is None else context_length,
            context_length_set=context_length is not None,
            model_dir=model_dir,
            block_size=block_size,
            max_loras_per_batch=max_loras_per_batch,
            max_lora_rank=max_lora_rank,
            max_loaded_loras=max_loaded_loras,
            lora_eviction_policy=lora_eviction_policy,
            lora_overlap_loading=lora_overlap_loading,
            lora_load_time_s=lora_load_time,
            time_scale=time_scale,
            fixed_step_ms=fixed_step_ms,
            profile_table=profile_table,
            kv_capacity_tokens=kv_capacity_tokens,
            kv_events_config=kv_events_config,
            lazy_lora_loading=lazy_lora_loading,
            priority_scheduling=priority_scheduling,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            speculative_num_steps=speculative_num_steps,
            speculative_acceptance=speculative_acceptance,
            eval_accuracy=eval_accuracy,
            answer_length_median=answer_length_median,
            speculative_draft_cost=speculative_draft_cost,
            mixed_chunk=mixed_chunk,
            tool_call_parser=tool_call_parser,
            disaggregation_mode=disaggregation_mode,
            disaggregation_bootstrap_port=disaggregation_bootstrap_port,
            disaggregation_transfer_backend=disaggregation_transfer_backend,
            disaggregation_ib_device=disaggregation_ib_device,
            disaggregation_decode_retraction_backup=disaggregation_decode_retraction_backup,
            disaggregation_decode_enable_radix_cache=disaggregation_decode_enable_radix_cache,
            num_reserved_decode_tokens=num_reserved_decode_tokens,
            kv_transfer_link=kv_transfer_link,
            kv_transfer_bandwidth_gb_s=kv_transfer_bandwidth,
            disable_radix_cache=disable_radix_cache,
            host=host,
            port=port,
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    if profile_table is not None:
        try:
            load_npz(profile_table)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--profile-table") from exc
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(
        create_app(config, faults=fault if fault_injection else None,  # type: ignore[arg-type]
                   time_scale_control=time_scale_control),
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level=log_level,
    )


@click.command("profile-table")
@click.option("--gpu", type=click.Choice(GPU_NAMES), default="H100", show_default=True, help="GPU of the timing model.")
@click.option(
    "--tp", type=click.Choice(["1", "2", "4", "8"]), default="2", show_default=True, help="Tensor-parallel degree."
)
@click.option(
    "--preset",
    type=click.Choice(PRESET_NAMES),
    default="latency",
    show_default=True,
    help="Timing constants (see sim-engine).",
)
@click.option("--max-prefill-tokens", default=32_768, show_default=True, type=click.IntRange(min=32),
              help="Largest prefill per iteration in the table (beyond it the table extrapolates linearly).")
@click.option("--max-context", default=131_072, show_default=True, type=click.IntRange(min=32),
              help="Largest mean context length in the decode table.")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False, writable=True),
              help="The .npz file to write.")
def profile_table_command(gpu: str, tp: str, preset: str, max_prefill_tokens: int, max_context: int, out: str) -> None:
    """Write the simulated engine's timing model as a profile table: prefill milliseconds by new
    tokens per iteration, decode milliseconds by KV tokens and mean context. The format is NVIDIA
    Dynamo's mocker `--planner-profile-data`; `inferbus sim-engine --profile-table` reads it back,
    so both engines run from one timing (see docs/sim-engine.md)."""
    from inferbus.timing import roofline

    from .profile_table import build_table, save_npz

    model = roofline(gpu, int(tp), preset)
    table = build_table(model, max_prefill_tokens=max_prefill_tokens, max_context=max_context)
    save_npz(table, out)
    click.echo(f"wrote {out}: {len(table.prefill_tokens)} prefill points, "
               f"{len(table.decode_kv_tokens)}×{len(table.decode_context)} decode grid "
               f"({gpu} TP{tp}, {model.kv_capacity_tokens():,} KV tokens)")
